"""Time split of the KLA forward: the composed map of each stretch of time, independent of the state.

With few sequences (``B * M / BLOCK_M`` programs cannot fill the GPU) the forward splits time into
``n_pieces`` stretches. A stretch's effect on ``(lam, eta)`` does not depend on the state entering
it when written in the merged homogeneous form (docs/math.md, section 6): with ``lam = u / w0`` and
``eta = w / w0`` one token is the linear map of ``(u, w0, w)``

    [[1 + noise phi, decay^2 phi, 0],
     [noise,         decay^2,     0],
     [b noise,       b decay^2,   decay]]          (phi = lam_v k^2, b = lam_v v k)

(the Möbius matrix of docs/math.md section 2 in the top-left block; ``w' = decay w + b w0'`` is the
mean update times the new denominator). Products stay of this lower block-triangular form, seven
numbers ``(A, B, C, D, x, y, z)``; this kernel composes them over a stretch, dividing by the trace
``A + D`` after each token (the maps act projectively; the 2x2 block has non-negative entries and a
positive trace, so the scale never cancels). ``kla_fwd_kernel`` then applies the maps of the earlier
stretches, in order, to the initial state: ``O(n_pieces^2)`` cheap map applications in all.

Packed documents (``VARLEN``): where a document starts (``starts[t] >= 0``) the map so far is
replaced by the constant map to that document's initial state, ``(A, B, C, D, x, y, z) = (0, lam0,
0, 1, 0, eta0, 0)`` (``lam' = lam0``, ``eta' = eta0`` whatever enters; trace 1), so a stretch holding
a document's start forgets the state before it.

Grid ``(B, ceil(M / BLOCK_M), n_pieces - 1)`` (the last stretch's map is never needed); output
``maps[b, piece, 7]``, float32 per-filter blocks (``(M, S)``, or ``(S, M)`` with ``STATES_FIRST``).
"""

import triton
import triton.language as tl

from kalmanscan.kernels.kla.common import kla_map_step, kla_reset, kla_row, kla_tile, kla_token


@triton.jit
def kla_piece_map_kernel(
    v_ptr, lam_v_ptr, k_ptr, q_ptr, decay_ptr, noise_ptr, maps_ptr, lam0_ptr, eta0_ptr, starts_ptr,
    L, M, S, piece_len, n_pieces,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr, STATES_FIRST: tl.constexpr, EVEN: tl.constexpr,
    HAS_INIT: tl.constexpr = False, VARLEN: tl.constexpr = False,
):
    pid_b, pid_m, offs_m, offs_s, mask_m, mask_s, mask, ms, decay, a2, noise, row_m, row_s = kla_tile(
        decay_ptr, noise_ptr, L, M, S, BLOCK_M, BLOCK_S, STATES_FIRST, EVEN)
    pid_p = tl.program_id(2)
    one = tl.full(mask.shape, 1.0, tl.float32)
    zero = tl.zeros(mask.shape, tl.float32)
    A, B, C, D, x, y, z = one, zero, zero, one, zero, zero, one
    t_begin = pid_p * piece_len
    t_end = tl.minimum(t_begin + piece_len, L)
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        if VARLEN:  # a document's start: the constant map to its initial state (lam0, eta0)
            start = kla_row(starts_ptr, t, mask) >= 0
            lam0, eta0 = kla_reset(zero, zero, lam0_ptr, eta0_ptr, starts_ptr, t, ms, mask, M * S, HAS_INIT)
            A = tl.where(start, zero, A)
            B = tl.where(start, lam0, B)
            C = tl.where(start, zero, C)
            D = tl.where(start, one, D)
            x = tl.where(start, zero, x)
            y = tl.where(start, eta0, y)
            z = tl.where(start, zero, z)
        lv, lvv, kt, qt = kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, M, S, mask_m, mask_s)
        A, B, C, D, x, y, z = kla_map_step(A, B, C, D, x, y, z, decay, a2, noise, lv, lvv, kt, STATES_FIRST)
    at = maps_ptr + (pid_b * n_pieces + pid_p) * 7 * M * S + ms
    tl.store(at, A, mask=mask)
    tl.store(at + M * S, B, mask=mask)
    tl.store(at + 2 * M * S, C, mask=mask)
    tl.store(at + 3 * M * S, D, mask=mask)
    tl.store(at + 4 * M * S, x, mask=mask)
    tl.store(at + 5 * M * S, y, mask=mask)
    tl.store(at + 6 * M * S, z, mask=mask)
