"""Time split of the KLA backward: the affine map each stretch applies to the adjoints, in one
forward walk with no scratch.

Walking backwards, token ``t`` maps the adjoints ``a = (gl, ge)`` of the state after it to those of
the state before it by ``a <- J_t (a + s_t)`` (:mod:`kalmanscan.kernels.kla.bwd`), with the upper
triangular ``J_t = [[j11, j12], [0, j22]]``,

    j11 = rho - noise lam_{t-1} rho^2 = decay^2 rho^2,   j12 = -noise decay eta_{t-1} rho^2,   j22 = rho decay,

(``rho (decay^2 + noise lam_{t-1}) = 1``; the second form has no cancellation) and the output
sources ``s_t = (s_l, s_e)``, ``s_e = gy q / lam_t``, ``s_l = -(gy q eta_t + gy_var q^2) / lam_t^2
= -s_e mu_t - gy_var (q / lam_t)^2`` with ``mu_t = eta_t / lam_t`` (without ``VAR``, no ``gy_var``
term). None of
these depends on the adjoints, so a stretch ``t0 .. t1`` maps the adjoint entering it (from later
tokens) to the one leaving it by

    a -> G a + h,    G = J_t0 J_t0+1 ... J_t1,    h = sum_t (J_t0 ... J_t) s_t.

Both are prefix products in *forward* time: with ``Q = J_t0 ... J_t`` updated as ``Q <- Q J_t``
and ``h += Q s_t``, each token needs only the state before and after it, which the forward
recursion produces in order. So a program starts from the checkpoint at its stretch's first chunk
and walks forward once, elementwise (no reduction over channels or states, no scratch, no
recomputed chunk), where composing backwards would need every chunk's states stored and read back.
The two orders compute the same map; they differ only in the rounding of the products.

Packed documents (``VARLEN``): the walk resets the state at documents' starts as the forward did,
and where a document ends at ``t`` the adjoint after ``t`` is that document's final-state
cotangent ``g`` alone, not what comes from later tokens: ``h += Q g`` and ``Q = 0`` from there on
(a stretch holding a document's end gives a constant map).

Grid ``(B, ceil(M / BLOCK_M), n_pieces - 1)`` over stretches ``1 .. n_pieces - 1`` (stretch 0's
map is never needed); output ``maps[b, piece, 5] = (G11, G12, G22, h1, h2)``, float32 per-filter blocks.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.kla.common import kla_reset, kla_row, kla_step_rho, kla_tile, kla_token, outer, per_m, per_s


@triton.jit
def kla_adjoint_map_kernel(
    v_ptr, lam_v_ptr, k_ptr, q_ptr, decay_ptr, noise_ptr, ckpt_lam_ptr, ckpt_eta_ptr,
    gy_ptr, gy_var_ptr, maps_ptr, glam_ptr, geta_ptr, lam0_ptr, eta0_ptr, starts_ptr, ends_ptr,
    L, M, S, n_chunks, piece_len, n_pieces,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr,
    STATES_FIRST: tl.constexpr, VAR: tl.constexpr, EVEN: tl.constexpr, HAS_INIT: tl.constexpr = False,
    VARLEN: tl.constexpr = False,
):
    pid_b, pid_m, offs_m, offs_s, mask_m, mask_s, mask, ms, decay, a2, noise, row_m, row_s = kla_tile(
        decay_ptr, noise_ptr, L, M, S, BLOCK_M, BLOCK_S, STATES_FIRST, EVEN)
    pid_p = tl.program_id(2) + 1
    MS = M * S
    t_begin = pid_p * piece_len
    t_end = tl.minimum(t_begin + piece_len, L)
    ck = (pid_b * n_chunks + t_begin // CHUNK) * MS + ms
    lam = tl.load(ckpt_lam_ptr + ck, mask=mask, other=1.0)
    eta = tl.load(ckpt_eta_ptr + ck, mask=mask, other=0.0)
    one = tl.full(mask.shape, 1.0, tl.float32)
    zero = tl.zeros(mask.shape, tl.float32)
    q11, q12, q22, h1, h2 = one, zero, one, zero, zero
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        lv, lvv, kt, qt = kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, M, S, mask_m, mask_s)
        gy = tl.load(gy_ptr + row_m + t * M, mask=mask_m, other=0.0).to(tl.float32)
        if VAR:
            gyv = tl.load(gy_var_ptr + row_m + t * M, mask=mask_m, other=0.0).to(tl.float32)
        if VARLEN:
            lam, eta = kla_reset(lam, eta, lam0_ptr, eta0_ptr, starts_ptr, t, ms, mask, MS, HAS_INIT)
        eta_p = eta
        lam, eta, rho = kla_step_rho(lam, eta, decay, a2, noise, lv, lvv, kt, STATES_FIRST)
        rho2 = rho * rho
        j11 = a2 * rho2
        j12 = -noise * decay * eta_p * rho2
        j22 = rho * decay
        inv = rcp(lam)
        s_e = outer(gy, qt, STATES_FIRST) * inv
        q12 = q11 * j12 + q12 * j22
        q11 = q11 * j11
        q22 = q22 * j22
        # q11 s_l + q12 s_e with s_l = -s_e mu (mu = eta / lam) and, with VAR, - gy_var (q / lam)^2
        h1 += s_e * (q12 - q11 * (eta * inv))
        if VAR:
            q_inv = per_s(qt, STATES_FIRST) * inv
            h1 -= q11 * per_m(gyv, STATES_FIRST) * (q_inv * q_inv)
        h2 += q22 * s_e
        if VARLEN:  # a document ends at t: the adjoint after t is its final state's cotangent alone
            d = kla_row(ends_ptr, t, mask)
            last = d >= 0
            gl = tl.load(glam_ptr + d * MS + ms, mask=mask & last, other=0.0)
            ge = tl.load(geta_ptr + d * MS + ms, mask=mask & last, other=0.0)
            h1 = tl.where(last, h1 + q11 * gl + q12 * ge, h1)
            h2 = tl.where(last, h2 + q22 * ge, h2)
            q11 = tl.where(last, zero, q11)
            q12 = tl.where(last, zero, q12)
            q22 = tl.where(last, zero, q22)
    at = maps_ptr + ((pid_b * n_pieces + pid_p) * 5) * MS + ms
    tl.store(at, q11, mask=mask)
    tl.store(at + MS, q12, mask=mask)
    tl.store(at + 2 * MS, q22, mask=mask)
    tl.store(at + 3 * MS, h1, mask=mask)
    tl.store(at + 4 * MS, h2, mask=mask)
