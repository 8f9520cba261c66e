"""Time split of the KLA backward: the affine map each stretch applies to the adjoints, in one
forward walk with no scratch.

Walking backwards, token ``t`` maps the adjoints ``a = (gs, ge)`` of the state after it
(:mod:`kalmanscan.kernels.kla.bwd`: ``gs = gl + ge mu``) to those of the state before it by
``a <- J_t (a + s_t)``, with the upper triangular ``J_t = [[j11, j12], [0, j22]]``,

    j11 = decay^2 rho^2,   j12 = j11 (decay mu_{t-1} phi - b) / lam_t,   j22 = rho decay,

(``phi = lam_v k^2``, ``b = lam_v v k``; no entry cancels) and the output sources ``s_t = (s_s,
s_e)``, ``s_e = gy q / lam_t``, ``s_s = -gy_var (q / lam_t)^2`` (without ``VAR``, no ``gy_var``
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
cotangent ``g = (glam + geta mu_t, geta)`` alone, not what comes from later tokens: ``h += Q g``
and ``Q = 0`` from there on (a stretch holding a document's end gives a constant map). The last
stretch's map takes the final state's cotangents as ``(glam, geta)``: ``G`` times ``[[1, mu_L],
[0, 1]]``, so every program carries ``(gs, ge)`` from the end.

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
    inv = rcp(lam)
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        lv, lvv, kt, qt = kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, M, S, mask_m, mask_s)
        gy = tl.load(gy_ptr + row_m + t * M, mask=mask_m, other=0.0).to(tl.float32)
        if VAR:
            gyv = tl.load(gy_var_ptr + row_m + t * M, mask=mask_m, other=0.0).to(tl.float32)
        if VARLEN:
            lam, eta = kla_reset(lam, eta, lam0_ptr, eta0_ptr, starts_ptr, t, ms, mask, MS, HAS_INIT)
            inv = rcp(lam)
        mu_p = eta * inv
        lam, eta, rho = kla_step_rho(lam, eta, decay, a2, noise, lv, lvv, kt, STATES_FIRST)
        inv = rcp(lam)
        j11 = a2 * (rho * rho)
        j12 = j11 * ((decay * mu_p) * outer(lv, kt * kt, STATES_FIRST) - outer(lvv, kt, STATES_FIRST)) * inv
        j22 = rho * decay
        s_e = outer(gy, qt, STATES_FIRST) * inv
        q12 = q11 * j12 + q12 * j22
        q11 = q11 * j11
        q22 = q22 * j22
        h1 += q12 * s_e  # q11 s_s + q12 s_e with s_s = - gy_var (q / lam)^2 (with VAR)
        if VAR:
            q_inv = per_s(qt, STATES_FIRST) * inv
            h1 -= q11 * per_m(gyv, STATES_FIRST) * (q_inv * q_inv)
        h2 += q22 * s_e
        if VARLEN:  # a document ends at t: the adjoint after t is its final state's cotangent alone
            d = kla_row(ends_ptr, t, mask)
            last = d >= 0
            gl = tl.load(glam_ptr + d * MS + ms, mask=mask & last, other=0.0)
            ge = tl.load(geta_ptr + d * MS + ms, mask=mask & last, other=0.0)
            h1 = tl.where(last, h1 + q11 * (gl + ge * (eta * inv)) + q12 * ge, h1)
            h2 = tl.where(last, h2 + q22 * ge, h2)
            q11 = tl.where(last, zero, q11)
            q12 = tl.where(last, zero, q12)
            q22 = tl.where(last, zero, q22)
    if pid_p == n_pieces - 1:  # the last stretch takes the final lam's cotangent: gs = gl + ge mu
        q12 += q11 * (eta * inv)
    at = maps_ptr + ((pid_b * n_pieces + pid_p) * 5) * MS + ms
    tl.store(at, q11, mask=mask)
    tl.store(at + MS, q12, mask=mask)
    tl.store(at + 2 * MS, q22, mask=mask)
    tl.store(at + 3 * MS, h1, mask=mask)
    tl.store(at + 4 * MS, h2, mask=mask)
