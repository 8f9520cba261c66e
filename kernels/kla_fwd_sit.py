"""KLA scan forward with the state dimension inside each thread (``KLAConfig(layout="s_in_thread")``).

Same recursion, outputs and checkpoints as :mod:`kernels.kla_fwd`; only the layout differs. A
program holds its filters as ``[BLOCK_S, BLOCK_M]`` tensors (state ``s`` first, channel ``m`` last)
with ``BLOCK_M = 32 * num_warps``: Triton's layouts for that shape put
consecutive channels on consecutive lanes and all ``BLOCK_S`` filters of a channel in one thread's
registers, so the per-token reductions

    y = sum_s q eta / lam,   y_var = sum_s q^2 / lam

are in-thread adds (no shuffles in the time loop) and each thread advances ``BLOCK_S`` independent
filter chains per token (instruction-level parallelism instead of resident warps).

How the layout is obtained (plain ``tl`` has no layout control; checked in the compiled code with
``python -m benchmarks.sass_stats kla_fwd_sit --dump``): Triton's default layout for a
``[BLOCK_S, 32 * num_warps]`` tensor is one element per thread along ``m``, lanes and warps along
``m``, and the ``BLOCK_S`` rows repeated in registers. The only accesses that could impose another
layout are those of per-filter data in the ``(m, s)`` memory layout (``decay``, ``noise``, initial
and final state, the stretch maps ``maps[b, piece, 7, m, s]`` of :mod:`kernels.kla_split`, the
checkpoints ``ckpt_lam/ckpt_eta[b, chunk, m, s]`` read by :mod:`kernels.kla_bwd`): contiguous along
``s``, they would make Triton's coalescing put ``s`` across lanes. Their offsets carry the hint
``tl.max_contiguous(.., 1)``, so those accesses take the default layout too: each lane reads or
writes its own channel's ``S`` values (once per program, and once per chunk for the checkpoints).
``k[b, t, :]`` and ``q[b, t, :]`` are the same ``2 S`` values for every thread (Triton's pipeliner
copies them to shared memory once per program and token; each thread reads them back with
128-bit loads). ``FULL_S`` (``S == BLOCK_S``) drops the masks over ``s``: with them (sixteen predicates
per thread) the compiled kernel needs 244-255 registers and, with ``HAS_INIT``, spills (56 B of
stack per thread, outside the time loop); without them 201 (230 with ``HAS_INIT`` and ``SAVE``).

Tensors and memory layouts are those of :mod:`kernels.kla_fwd`, so the wrapper, the checkpoints and
the backward are shared. Grid ``(B, ceil(M / BLOCK_M), n_pieces)``. Two channels per thread
(``BLOCK_M = 64 * num_warps``) compiles to the same layout but spills heavily (2.3 KB of stack per
thread at 2 warps), so the wrapper launches one. Numerics: float32, the operations of
:mod:`kernels.kla_fwd` (hardware reciprocal, padding filters ``decay = 1, noise = 0, k = q = 0``
inert), summed over ``s`` in the order the compiler chooses.
"""

import triton
import triton.language as tl

from .fast_math import rcp
from .kla_common import kla_checkpoint, kla_enter, kla_step_sm, kla_token


@triton.jit
def kla_fwd_sit_kernel(
    v_ptr, lam_v_ptr, k_ptr, q_ptr, decay_ptr, noise_ptr, lam0_ptr, eta0_ptr, maps_ptr,
    y_ptr, y_var_ptr, lam_out_ptr, eta_out_ptr, ckpt_lam_ptr, ckpt_eta_ptr,
    L, M, S, n_chunks, piece_len, n_pieces,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_INIT: tl.constexpr, SAVE: tl.constexpr, FULL_S: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_p = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BLOCK_S)
    mask_m = offs_m < M
    if FULL_S:
        mask_s = offs_s < BLOCK_S
    else:
        mask_s = offs_s < S
    mask = mask_s[:, None] & mask_m[None, :]
    ms = tl.max_contiguous(offs_m[None, :] * S + offs_s[:, None], [1, 1])
    state = pid_b * M * S + ms
    lam, eta = kla_enter(lam0_ptr, eta0_ptr, maps_ptr, state, ms, mask, pid_b, pid_p, n_pieces, M, S, HAS_INIT)
    decay = tl.load(decay_ptr + ms, mask=mask, other=1.0)
    noise = tl.load(noise_ptr + ms, mask=mask, other=0.0)
    a2 = decay * decay
    row_m = pid_b * L * M + offs_m
    row_s = pid_b * L * S + offs_s
    t_begin = pid_p * piece_len
    t_end = tl.minimum(t_begin + piece_len, L)
    for t in tl.range(t_begin, t_end, num_stages=STAGES, loop_unroll_factor=UNROLL):
        if SAVE:
            kla_checkpoint(ckpt_lam_ptr, ckpt_eta_ptr, lam, eta, t, pid_b, n_chunks, ms, mask, M, S, CHUNK)
        lv, lvv, kt, qt = kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, M, S, mask_m, mask_s)
        lam, eta = kla_step_sm(lam, eta, decay, a2, noise, lv, lvv, kt)
        qi = qt[:, None] * rcp(lam)
        y = tl.sum(qi * eta, axis=0)
        y_var = tl.sum(qi * qt[:, None], axis=0)
        tl.store(y_ptr + row_m + t * M, y.to(y_ptr.dtype.element_ty), mask=mask_m)
        tl.store(y_var_ptr + row_m + t * M, y_var.to(y_var_ptr.dtype.element_ty), mask=mask_m)
    if pid_p == n_pieces - 1:
        tl.store(lam_out_ptr + state, lam, mask=mask)
        tl.store(eta_out_ptr + state, eta, mask=mask)
