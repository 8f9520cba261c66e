"""Fused forward of the KLA scan (docs/math.md, section 7): the state never leaves registers.

One program per ``(batch b, block of BLOCK_M channels of M, stretch of time)`` holds its
grid of filters ``(lam, eta)`` in registers (either orientation, ``STATES_FIRST``:
``kalmanscan.kernels.kla.common``) and walks its stretch of time
sequentially. Per token it reads ``v[b, t, m]``, ``lam_v[b, t, m]``, ``k[b, t, :]``, ``q[b, t, :]``,
applies ``kalmanscan.kernels.kla.common.kla_step`` and writes

    y = sum_s q eta / lam,   y_var = sum_s q^2 / lam      (reduced over s inside the program)

(``y_var`` only with ``VAR``: without it the kernel neither computes nor writes it).

Time is one stretch (``n_pieces = 1``) unless few programs would fill the GPU; then
``kalmanscan.kernels.kla.split`` has written the composed map of every earlier stretch to ``maps`` and a program
of stretch ``p`` starts by applying maps ``0 .. p-1`` to the initial state.
With ``SAVE`` the state at the start of every chunk of ``CHUNK`` tokens is written to
``ckpt_lam/ckpt_eta[b, chunk]`` (a per-filter block) for the backward (memory ``B M S L / CHUNK``; stretches are
whole chunks). The loop is bound by latency, not arithmetic: ``STAGES`` lets Triton's software
pipeliner load tokens ahead (measured faster than a hand-written register ring), ``UNROLL`` unrolls
the time loop.

Packed documents (``VARLEN``, one batch row; ``kalmanscan.ops.kla.documents``): before token
``t`` the state is reset where a document starts (``starts[t] = d >= 0``: row ``d`` of the initial
state, ``(N, M, S)`` blocks, with ``HAS_INIT``), and after it stored to row ``ends[t]`` of the final
state where a document ends; the reset comes before the checkpoint, so a chunk recomputed from it
resets again to the same values.

Numerics: float32 whatever the input dtype. Every term of the precision update is positive
(``lam > 0`` stays ``> 0``: ``rho lam = lam / (decay^2 + noise lam) > 0``), so nothing cancels in
``lam`` and the divisions are by positive numbers. With ``noise > 0``, ``lam <= 1/noise + max phi``
stays bounded; with ``noise = 0`` and ``decay < 1`` the exact ``lam`` grows like ``decay^(-2t)``.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.kla.common import (kla_checkpoint, kla_enter, kla_reset, kla_step, kla_store_row, kla_tile,
                                           kla_token, per_s, sum_s)


@triton.jit
def kla_fwd_kernel(
    v_ptr, lam_v_ptr, k_ptr, q_ptr, decay_ptr, noise_ptr, lam0_ptr, eta0_ptr, maps_ptr,
    y_ptr, y_var_ptr, lam_out_ptr, eta_out_ptr, ckpt_lam_ptr, ckpt_eta_ptr, starts_ptr, ends_ptr,
    L, M, S, n_chunks, piece_len, n_pieces,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_INIT: tl.constexpr, SAVE: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
    STATES_FIRST: tl.constexpr, VAR: tl.constexpr, EVEN: tl.constexpr, VARLEN: tl.constexpr = False,
):
    pid_b, pid_m, offs_m, offs_s, mask_m, mask_s, mask, ms, decay, a2, noise, row_m, row_s = kla_tile(
        decay_ptr, noise_ptr, L, M, S, BLOCK_M, BLOCK_S, STATES_FIRST, EVEN)
    pid_p = tl.program_id(2)
    state = pid_b * M * S + ms
    lam, eta = kla_enter(lam0_ptr, eta0_ptr, maps_ptr, state, ms, mask, pid_b, pid_p, n_pieces, M, S, HAS_INIT)

    t_begin = pid_p * piece_len
    t_end = tl.minimum(t_begin + piece_len, L)
    for t in tl.range(t_begin, t_end, num_stages=STAGES, loop_unroll_factor=UNROLL):
        if VARLEN:
            lam, eta = kla_reset(lam, eta, lam0_ptr, eta0_ptr, starts_ptr, t, ms, mask, M * S, HAS_INIT)
        if SAVE:
            kla_checkpoint(ckpt_lam_ptr, ckpt_eta_ptr, lam, eta, t, pid_b, n_chunks, ms, mask, M, S, CHUNK)
        lv, lvv, kt, qt = kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, M, S, mask_m, mask_s)
        lam, eta = kla_step(lam, eta, decay, a2, noise, lv, lvv, kt, STATES_FIRST)
        inv = rcp(lam)
        qs = per_s(qt, STATES_FIRST)
        qi = qs * inv
        y = sum_s(qi * eta, STATES_FIRST)
        if VAR:
            y_var = sum_s(qi * qs, STATES_FIRST)
        tl.store(y_ptr + row_m + t * M, y.to(y_ptr.dtype.element_ty), mask=mask_m)
        if VAR:
            tl.store(y_var_ptr + row_m + t * M, y_var.to(y_var_ptr.dtype.element_ty), mask=mask_m)
        if VARLEN:
            kla_store_row(lam_out_ptr, eta_out_ptr, lam, eta, ends_ptr, t, ms, mask, M * S)
    if not VARLEN:
        if pid_p == n_pieces - 1:
            tl.store(lam_out_ptr + state, lam, mask=mask)
            tl.store(eta_out_ptr + state, eta, mask=mask)
