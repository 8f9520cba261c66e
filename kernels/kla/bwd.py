"""Fused backward of the KLA scan: chunks in reverse, each recomputed from its checkpoint.

Same programs as the forward (``(batch b, block of BLOCK_M channels)``, state grid in registers).
For each chunk, last first: reload the chunk's starting state from ``ckpt_lam/ckpt_eta``, recompute
the chunk forward writing the state before every step to the program's private ``scratch``
(``CHUNK x BLOCK_M x BLOCK_S`` per program, sized so that the resident programs' scratch stays in
L2: ``KLAConfig.chunk``), then walk the chunk backwards with two scalar adjoints of every filter:
``ge = dLoss/d eta_t`` and ``gs = gl + ge mu_t``, where ``gl = dLoss/d lam_t`` and ``mu_t = eta_t /
lam_t`` (``gs = -dLoss/d var_t / lam_t^2``, the variance's adjoint scaled):

    from the outputs:  ge += gy q / lam_t,   gs -= gy_var (q / lam_t)^2
    through the step:  d = decay^2 + noise lam_{t-1},  rho = 1/d,  phi = lam_v k^2,  b = lam_v v k
        w = ge (decay mu_{t-1} phi - b) / lam_t          (= ge (decay mu_{t-1} - mu_t))
        g_d = -(gs + w) lam_{t-1} rho^2                   (dLoss/dd: gl lam_{t-1} + ge decay eta_{t-1})
        decay += ge rho eta_{t-1} + 2 decay g_d,     noise += g_d lam_{t-1}
        gl = gs - ge mu_t:  lam_v[m] += sum_s gl k^2 + ge v k,   v[m] += lam_v sum_s ge k
        k[s] += sum_m lam_v (2 k gl + v ge),  q[s] += sum_m (gy mu_t + 2 gy_var q / lam_t)
        ge <- ge rho decay,   gs <- (gs + w) decay^2 rho^2

Without ``VAR`` (a forward that did not return ``y_var``) the ``gy_var`` terms are left out and
``gy_var`` is never read. With ``KEEP = "evict_last"`` and ``STREAM = "evict_first"``
(``KLAConfig.l2_hints``) L2 keeps the scratch in preference to the data read or written once (the
checkpoints, the last reads of the inputs, the gradients written); ``""`` for both leaves the
caches' defaults. Loads that the software pipeline turns into asynchronous copies keep the
default whatever the policy. ``1 / lam_{t-1}`` is the reciprocal the next step back reuses as its
``1 / lam_t`` (one reciprocal a token, as with ``gl``); ``sum_s ge k`` serves both ``v`` and ``lam_v``.

Why ``gs`` and not ``gl``. Where the precision is large (``lam ~ 1/noise``, or a large initial one)
the two adjoints nearly cancel: ``gl ~ -ge mu`` to within the variance's adjoint over ``lam^2``, so
``gl`` rounded in float32 had no digit of that difference left, and the decay and noise gradients,
built from ``gl lam_{t-1} + ge decay eta_{t-1}``, none either (the noise gradient at ``lam0 = 1e12``
without noise: 1.8e4 relative error with ``gl``, 1e-7 with ``gs``; the initial precision's at
``noise = 1e-3``: 0 or 1e-22 against -1e-24). In ``(gs, ge)`` every update is a product or a sum
of terms that do not cancel by construction (``tests/ops/kla/test_oracle.py``). The final lam's
cotangent enters as ``gs = glam + geta mu_L`` (in the last stretch's first chunk); the initial
state's gradients leave as ``glam0 = gs - ge mu_0``.

The adjoint recursions are the exact transposes of the forward's scalar recursions (never of the
normalised 2x2 products), all divisions are by ``d >= decay^2 > 0`` and ``lam_t > 0``. Sums over s
and m are done within the program; sums over m of the ``k``/``q`` gradients become one partial per program,
``gk_part/gq_part[b, t, pid_m, s]``, summed by the caller (deterministic, no atomics). ``decay`` and
``noise`` gradients accumulate over time in registers and are written per batch row and stretch
(``gdecay_part/gnoise_part[b, piece]``, per-filter blocks), summed by the caller. The adjoints left after
``t = 0`` are the gradients of the initial state. ``STAGES`` and ``UNROLL`` are the time loops'
software-pipelining depth and unroll factor.

Packed documents (``VARLEN``): the scratch keeps the state after each token before a document's
reset (the walk back needs the previous document's final state), and the reset is applied to it
as it is read, as the forward did (``kla_reset``). Walking back, the adjoints are set to the final
state's cotangents of document ``ends[t]`` before its last token ``t`` (``gs = glam + geta mu``;
nothing flows back across a document's start) and, after a document's first token, stored as
that document's initial-state gradients.

Time split. With ``n_pieces > 1`` the program of stretch ``p`` first carries the final adjoint
through the affine adjoint maps ``maps[b, piece, 5]`` of stretches ``n_pieces - 1 .. p + 1``
(composed by :mod:`kalmanscan.kernels.kla.adjoint_map`), then back-propagates through its own
stretch.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.kla.common import (kla_adjoint_row, kla_reset, kla_step, kla_store_row, kla_tile,
                                           kla_token, outer, per_m, per_s, sum_m, sum_s)


@triton.jit
def kla_bwd_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, gy_ptr, gy_var_ptr, scratch_lam_ptr, scratch_eta_ptr,
                  row_m, row_s, slot, t, M, S, mask_m, mask_s, VAR: tl.constexpr, KEEP: tl.constexpr,
                  STREAM: tl.constexpr):
    """The state before step ``t`` (``slot`` of ``scratch``), the float32 inputs and output gradients
    of token ``t`` (``gy_var`` read only with ``VAR``, else ``gy`` in its place, unused). ``KEEP``
    and ``STREAM`` are the eviction policies of the scratch and of the per-channel inputs read for
    the last time."""
    lam_p = tl.load(scratch_lam_ptr + slot, eviction_policy=KEEP)
    eta_p = tl.load(scratch_eta_ptr + slot, eviction_policy=KEEP)
    lv = tl.load(lam_v_ptr + row_m + t * M, mask=mask_m, other=1.0, eviction_policy=STREAM).to(tl.float32)
    vv = tl.load(v_ptr + row_m + t * M, mask=mask_m, other=0.0, eviction_policy=STREAM).to(tl.float32)
    kt = tl.load(k_ptr + row_s + t * S, mask=mask_s, other=0.0).to(tl.float32)
    qt = tl.load(q_ptr + row_s + t * S, mask=mask_s, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + row_m + t * M, mask=mask_m, other=0.0, eviction_policy=STREAM).to(tl.float32)
    if VAR:
        gyv = tl.load(gy_var_ptr + row_m + t * M, mask=mask_m, other=0.0,
                      eviction_policy=STREAM).to(tl.float32)
    else:
        gyv = gy
    return lam_p, eta_p, lv, vv, kt, qt, gy, gyv


@triton.jit
def kla_bwd_kernel(
    v_ptr, lam_v_ptr, k_ptr, q_ptr, decay_ptr, noise_ptr, ckpt_lam_ptr, ckpt_eta_ptr,
    gy_ptr, gy_var_ptr, glam_ptr, geta_ptr, scratch_lam_ptr, scratch_eta_ptr, maps_ptr,
    gv_ptr, glam_v_ptr, gk_part_ptr, gq_part_ptr, gdecay_part_ptr, gnoise_part_ptr,
    glam0_ptr, geta0_ptr, lam0_ptr, eta0_ptr, starts_ptr, ends_ptr,
    L, M, S, n_chunks, n_mblocks, piece_len, n_pieces,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr,
    UNROLL: tl.constexpr, STATES_FIRST: tl.constexpr, VAR: tl.constexpr, EVEN: tl.constexpr,
    KEEP: tl.constexpr, STREAM: tl.constexpr, HAS_INIT: tl.constexpr = False, VARLEN: tl.constexpr = False,
):
    pid_b, pid_m, offs_m, offs_s, mask_m, mask_s, mask, ms, decay, a2, noise, row_m, row_s = kla_tile(
        decay_ptr, noise_ptr, L, M, S, BLOCK_M, BLOCK_S, STATES_FIRST, EVEN)
    pid_p = tl.program_id(2)
    SLOT: tl.constexpr = BLOCK_M * BLOCK_S
    MS = M * S
    state = pid_b * MS + ms
    zero = tl.zeros(mask.shape, tl.float32)
    gs = tl.load(glam_ptr + state, mask=mask, other=0.0)  # gl at the end, made gs in the last stretch
    ge = tl.load(geta_ptr + state, mask=mask, other=0.0)
    for qq in range(n_pieces - 1 - pid_p):
        at = maps_ptr + ((pid_b * n_pieces + n_pieces - 1 - qq) * 5) * MS + ms
        m11 = tl.load(at, mask=mask, other=1.0)
        m12 = tl.load(at + MS, mask=mask, other=0.0)
        m22 = tl.load(at + 2 * MS, mask=mask, other=1.0)
        gs = m11 * gs + m12 * ge + tl.load(at + 3 * MS, mask=mask, other=0.0)
        ge = m22 * ge + tl.load(at + 4 * MS, mask=mask, other=0.0)
    gdecay = zero
    gnoise = zero

    if STATES_FIRST:  # each filter's place in the program's grid, row by row
        in_grid = offs_s[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    else:
        in_grid = tl.arange(0, BLOCK_M)[:, None] * BLOCK_S + offs_s[None, :]
    slot = ((pid_b * n_mblocks + pid_m) * n_pieces + pid_p) * CHUNK * SLOT + in_grid
    part = (pid_b * L * n_mblocks + pid_m) * S + offs_s
    c_begin = pid_p * (piece_len // CHUNK)
    c_end = tl.minimum(c_begin + piece_len // CHUNK, n_chunks)
    for cc in range(c_end - c_begin):
        c = c_end - 1 - cc
        ck = (pid_b * n_chunks + c) * MS + ms
        lam = tl.load(ckpt_lam_ptr + ck, mask=mask, other=1.0, eviction_policy=STREAM)
        eta = tl.load(ckpt_eta_ptr + ck, mask=mask, other=0.0, eviction_policy=STREAM)
        t0 = c * CHUNK
        t1 = tl.minimum(t0 + CHUNK, L)

        # Recompute the chunk, keeping the state before every step.
        for t in tl.range(t0, t1, num_stages=STAGES, loop_unroll_factor=UNROLL):
            tl.store(scratch_lam_ptr + slot + (t - t0) * SLOT, lam, eviction_policy=KEEP)
            tl.store(scratch_eta_ptr + slot + (t - t0) * SLOT, eta, eviction_policy=KEEP)
            if VARLEN:
                lam, eta = kla_reset(lam, eta, lam0_ptr, eta0_ptr, starts_ptr, t, ms, mask, MS, HAS_INIT)
            lv, lvv, kt, qt = kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, M, S,
                                        mask_m, mask_s)
            lam, eta = kla_step(lam, eta, decay, a2, noise, lv, lvv, kt, STATES_FIRST)
        if (pid_p == n_pieces - 1) & (cc == 0):  # the final lam's cotangent made the carried gs
            gs += ge * (eta * rcp(lam))
        tl.debug_barrier()  # scratch written by one thread may be read by another

        # Walk the chunk backwards; (lam, eta) is the state after step t, inv = 1 / lam.
        inv = rcp(lam)
        for i in tl.range(0, t1 - t0, num_stages=STAGES, loop_unroll_factor=UNROLL):
            t = t1 - 1 - i
            mu = eta * inv
            if VARLEN:  # a document's last token: the adjoints restart from its final state's
                gs, ge = kla_adjoint_row(gs, ge, mu, glam_ptr, geta_ptr, ends_ptr, t, ms, mask, MS)
            lam_p, eta_p, lv, vv, kt, qt, gy, gyv = kla_bwd_token(
                v_ptr, lam_v_ptr, k_ptr, q_ptr, gy_ptr, gy_var_ptr, scratch_lam_ptr, scratch_eta_ptr,
                row_m, row_s, slot + (t - t0) * SLOT, t, M, S, mask_m, mask_s, VAR, KEEP, STREAM)
            lam_after = lam_p  # the state after token t - 1 (before a document's reset)
            eta_after = eta_p
            inv_p = rcp(lam_p)
            inv_after = inv_p
            if VARLEN:
                lam_p, eta_p = kla_reset(lam_p, eta_p, lam0_ptr, eta0_ptr, starts_ptr, t, ms, mask, MS, HAS_INIT)
                inv_p = rcp(lam_p)

            s_e = outer(gy, qt, STATES_FIRST) * inv
            rho = rcp(a2 + noise * lam_p)
            ge += s_e
            if VAR:
                q_inv = per_s(qt, STATES_FIRST) * inv
                gs -= per_m(gyv, STATES_FIRST) * (q_inv * q_inv)
                gq = sum_m(per_m(gy, STATES_FIRST) * mu + per_m(2.0 * gyv, STATES_FIRST) * q_inv, STATES_FIRST)
            else:
                gq = sum_m(per_m(gy, STATES_FIRST) * mu, STATES_FIRST)
            kk = per_s(kt, STATES_FIRST)
            # w = ge (decay mu_{t-1} phi - b) / lam_t = ge (decay mu_{t-1} - mu_t): no cancellation
            innovation = (decay * (eta_p * inv_p)) * outer(lv, kt * kt, STATES_FIRST) - outer(lv * vv, kt, STATES_FIRST)
            w = ge * innovation * inv
            rho2 = rho * rho
            g_d = -(gs + w) * lam_p * rho2
            gdecay += ge * eta_p * rho + 2.0 * decay * g_d
            gnoise += g_d * lam_p
            gl = gs - ge * mu
            ek = sum_s(ge * kk, STATES_FIRST)
            glv = sum_s(gl * (kk * kk), STATES_FIRST) + vv * ek
            gv = ek * lv
            gk = sum_m(per_m(lv, STATES_FIRST) * (2.0 * kk * gl) + per_m(lv * vv, STATES_FIRST) * ge, STATES_FIRST)
            tl.store(glam_v_ptr + row_m + t * M, glv.to(glam_v_ptr.dtype.element_ty), mask=mask_m,
                     eviction_policy=STREAM)
            tl.store(gv_ptr + row_m + t * M, gv.to(gv_ptr.dtype.element_ty), mask=mask_m, eviction_policy=STREAM)
            tl.store(gk_part_ptr + part + t * n_mblocks * S, gk, mask=mask_s, eviction_policy=STREAM)
            tl.store(gq_part_ptr + part + t * n_mblocks * S, gq, mask=mask_s, eviction_policy=STREAM)
            ge = ge * (rho * decay)
            gs = (gs + w) * (a2 * rho2)
            if VARLEN:  # a document's first token: the adjoints are its initial state's gradients
                kla_store_row(glam0_ptr, geta0_ptr, gs - ge * (eta_p * inv_p), ge, starts_ptr, t, ms, mask, MS)
            lam = lam_after
            eta = eta_after
            inv = inv_after
        tl.debug_barrier()  # every read of this chunk's scratch is done before it is overwritten
    part_ms = (pid_b * n_pieces + pid_p) * MS + ms
    tl.store(gdecay_part_ptr + part_ms, gdecay, mask=mask)
    tl.store(gnoise_part_ptr + part_ms, gnoise, mask=mask)
    if not VARLEN:
        if pid_p == 0:  # the first chunk's checkpoint is the initial state
            first = pid_b * n_chunks * MS + ms
            lam = tl.load(ckpt_lam_ptr + first, mask=mask, other=1.0)
            eta = tl.load(ckpt_eta_ptr + first, mask=mask, other=0.0)
            tl.store(glam0_ptr + state, gs - ge * (eta * rcp(lam)), mask=mask)
            tl.store(geta0_ptr + state, ge, mask=mask)
