"""Building blocks shared by the KLA kernels (``kla_fwd``, ``kla_bwd``, ``kla_split``).

A program owns a grid of filters ``(m, s)``: ``BLOCK_M`` channels of one batch row, ``BLOCK_S``
states each. Per-channel token inputs are ``[BLOCK_M]`` vectors, per-state ones ``[BLOCK_S]``.
Arithmetic is float32; reciprocals are the hardware instruction (:func:`kernels.fast_math.rcp`, at
most one ulp off). Padding lanes (``m >= M`` or ``s >= S``) carry ``decay = 1, noise = 0,
k = q = 0`` and stay inert.

Two orientations of the grid, the constexpr ``STATES_FIRST`` of every kernel:

- ``False``: ``[BLOCK_M, BLOCK_S]``. Triton spreads a channel's states over lanes, so the sums over
  ``s`` are shuffles, and a warp covers few channels: many warps resident to hide each token's
  dependent chain, the better shape when the batch rows and channel blocks alone fill the GPU.
- ``True``: ``[BLOCK_S, BLOCK_M]``. A thread holds one channel's states in its registers (sums over
  ``s`` in-thread, sums over ``m`` across lanes) and the per-filter tensors (``decay``, ``noise``,
  states, checkpoints, maps) are laid out ``(..., S, M)`` in memory, so that a warp's lanes read
  consecutive channels. Fewer instructions a token but fewer warps; it wins where time is split
  into stretches anyway (few sequences, docs/decisions.md, "The KLA scan").

The helpers below (:func:`per_m`, :func:`per_s`, :func:`outer`, :func:`sum_s`, :func:`sum_m`) put
vectors on the grid and reduce it in either orientation.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp


@triton.jit
def per_m(x, STATES_FIRST: tl.constexpr):
    """The ``[BLOCK_M]`` vector ``x`` on the grid's channel axis (size 1 along the states)."""
    if STATES_FIRST:
        out = x[None, :]
    else:
        out = x[:, None]
    return out


@triton.jit
def per_s(x, STATES_FIRST: tl.constexpr):
    """The ``[BLOCK_S]`` vector ``x`` on the grid's state axis (size 1 along the channels)."""
    if STATES_FIRST:
        out = x[:, None]
    else:
        out = x[None, :]
    return out


@triton.jit
def outer(xm, xs, STATES_FIRST: tl.constexpr):
    """``xm[m] xs[s]`` on the grid (the vector along the grid's first axis is the left factor)."""
    if STATES_FIRST:
        out = xs[:, None] * xm[None, :]
    else:
        out = xm[:, None] * xs[None, :]
    return out


@triton.jit
def sum_s(x, STATES_FIRST: tl.constexpr):
    """The grid summed over its states: a ``[BLOCK_M]`` vector."""
    return tl.sum(x, axis=0 if STATES_FIRST else 1)


@triton.jit
def sum_m(x, STATES_FIRST: tl.constexpr):
    """The grid summed over its channels: a ``[BLOCK_S]`` vector."""
    return tl.sum(x, axis=1 if STATES_FIRST else 0)


@triton.jit
def kla_step_rho(lam, eta, decay, a2, noise, lv, lvv, kt, STATES_FIRST: tl.constexpr):
    """One predict-then-update step of the filter grid (docs/math.md, section 7):
    ``rho = 1/(decay^2 + noise lam)``, ``lam <- rho lam + lam_v k^2``,
    ``eta <- rho decay eta + lam_v v k``; returns the new ``(lam, eta)`` and ``rho``."""
    rho = rcp(a2 + noise * lam)
    lam_next = rho * lam + outer(lv, kt * kt, STATES_FIRST)
    eta_next = (rho * decay) * eta + outer(lvv, kt, STATES_FIRST)
    return lam_next, eta_next, rho


@triton.jit
def kla_step(lam, eta, decay, a2, noise, lv, lvv, kt, STATES_FIRST: tl.constexpr):
    """:func:`kla_step_rho` without ``rho``."""
    lam, eta, _ = kla_step_rho(lam, eta, decay, a2, noise, lv, lvv, kt, STATES_FIRST)
    return lam, eta


@triton.jit
def kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, M, S, mask_m, mask_s):
    """Float32 ``(lam_v, lam_v v)`` at channels ``row_m`` and ``(k, q)`` of token ``t``."""
    lv = tl.load(lam_v_ptr + row_m + t * M, mask=mask_m, other=1.0).to(tl.float32)
    vv = tl.load(v_ptr + row_m + t * M, mask=mask_m, other=0.0).to(tl.float32)
    kt = tl.load(k_ptr + row_s + t * S, mask=mask_s, other=0.0).to(tl.float32)
    qt = tl.load(q_ptr + row_s + t * S, mask=mask_s, other=0.0).to(tl.float32)
    return lv, lv * vv, kt, qt


@triton.jit
def kla_tile(decay_ptr, noise_ptr, L, M, S, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
             STATES_FIRST: tl.constexpr, EVEN: tl.constexpr):
    """The program's batch row ``pid_b`` and channel block ``pid_m`` (grid axes 0 and 1), its
    offsets and masks, the offsets ``ms`` of its filters in a per-filter ``(M, S)`` tensor (``(S, M)``
    with ``STATES_FIRST``), ``decay``, ``decay^2`` and ``noise`` of its filters (read from ``(M, S)``
    tensors in either layout: once a program, so the launcher copies nothing to turn them), and
    the offsets ``row_m``/``row_s`` of token 0 of its row in ``(B, L, M)`` and ``(B, L, S)`` tensors.

    Padding lanes get ``decay = 1, noise = 0`` (an identity predict step). With ``EVEN`` (the
    launcher's promise that ``BLOCK_M`` divides ``M`` and ``BLOCK_S == S``) there are none: the
    masks are constant true, and the compiler drops them and their selects from every access.
    """
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BLOCK_S)
    if EVEN:
        mask_m = tl.full([BLOCK_M], 1, tl.int1)
        mask_s = tl.full([BLOCK_S], 1, tl.int1)
    else:
        mask_m = offs_m < M
        mask_s = offs_s < S
    if STATES_FIRST:
        mask = mask_s[:, None] & mask_m[None, :]
        ms = offs_s[:, None] * M + offs_m[None, :]
        params = offs_s[:, None] + offs_m[None, :] * S
    else:
        mask = mask_m[:, None] & mask_s[None, :]
        ms = offs_m[:, None] * S + offs_s[None, :]
        params = ms
    decay = tl.load(decay_ptr + params, mask=mask, other=1.0)
    noise = tl.load(noise_ptr + params, mask=mask, other=0.0)
    row_m = pid_b * L * M + offs_m
    row_s = pid_b * L * S + offs_s
    return pid_b, pid_m, offs_m, offs_s, mask_m, mask_s, mask, ms, decay, decay * decay, noise, row_m, row_s


@triton.jit
def kla_map_step(A, B, C, D, x, y, z, decay, a2, noise, lv, lvv, kt, STATES_FIRST: tl.constexpr):
    """Compose one token's step after the stretch map ``(A, B, C, D, x, y, z)`` (see ``kla_split``).

    The step is the linear map ``[[1 + noise phi, decay^2 phi, 0], [noise, decay^2, 0],
    [b noise, b decay^2, decay]]`` of ``(u, w0, w)`` (``lam = u/w0``, ``eta = w/w0``,
    ``phi = lam_v k^2``, ``b = lam_v v k``). The product is divided by its 2x2 trace ``A + D``
    (positive): the maps act projectively, so the scale is free, and the entries stay in range.
    """
    phi = outer(lv, kt * kt, STATES_FIRST)
    b = outer(lvv, kt, STATES_FIRST)
    C1 = noise * A + a2 * C
    D1 = noise * B + a2 * D
    A1 = A + phi * C1          # (1 + noise phi) A + decay^2 phi C: every term non-negative
    B1 = B + phi * D1
    x1 = decay * x + b * C1
    y1 = decay * y + b * D1
    r = rcp(A1 + D1)
    return A1 * r, B1 * r, C1 * r, D1 * r, x1 * r, y1 * r, (decay * z) * r


@triton.jit
def kla_map_apply(lam, eta, A, B, C, D, x, y, z):
    """The state after a stretch with map ``(A, B, C, D, x, y, z)`` from the state ``(lam, eta)``:
    ``lam' = (A lam + B) / (C lam + D)``, ``eta' = (x lam + y + z eta) / (C lam + D)``."""
    r = rcp(C * lam + D)
    return (A * lam + B) * r, (x * lam + y + z * eta) * r


@triton.jit
def kla_enter(lam0_ptr, eta0_ptr, maps_ptr, state, ms, mask, pid_b, pid_p, n_pieces, M, S,
              HAS_INIT: tl.constexpr):
    """The state ``(lam, eta)`` at the start of stretch ``pid_p``: the initial state at offsets
    ``state`` (``lam = 1, eta = 0`` without ``HAS_INIT``) carried through the maps of stretches
    ``0 .. pid_p - 1`` (``maps[b, piece, 7]``, each a per-filter block read at offsets ``ms``, see
    ``kla_split``)."""
    if HAS_INIT:
        lam = tl.load(lam0_ptr + state, mask=mask, other=1.0)
        eta = tl.load(eta0_ptr + state, mask=mask, other=0.0)
    else:
        lam = tl.full(mask.shape, 1.0, tl.float32)
        eta = tl.zeros(mask.shape, tl.float32)
    for p in range(pid_p):
        at = maps_ptr + (pid_b * n_pieces + p) * 7 * M * S + ms
        lam, eta = kla_map_apply(
            lam, eta, tl.load(at, mask=mask, other=1.0), tl.load(at + M * S, mask=mask, other=0.0),
            tl.load(at + 2 * M * S, mask=mask, other=0.0), tl.load(at + 3 * M * S, mask=mask, other=1.0),
            tl.load(at + 4 * M * S, mask=mask, other=0.0), tl.load(at + 5 * M * S, mask=mask, other=0.0),
            tl.load(at + 6 * M * S, mask=mask, other=1.0))
    return lam, eta


@triton.jit
def kla_checkpoint(ckpt_lam_ptr, ckpt_eta_ptr, lam, eta, t, pid_b, n_chunks, ms, mask, M, S,
                   CHUNK: tl.constexpr):
    """At a chunk start (``t % CHUNK == 0``) store the state before token ``t`` to
    ``ckpt_lam/ckpt_eta[b, t // CHUNK]`` (offsets ``ms`` within a batch's per-filter block)."""
    if t % CHUNK == 0:
        ck = (pid_b * n_chunks + t // CHUNK) * M * S + ms
        tl.store(ckpt_lam_ptr + ck, lam, mask=mask)
        tl.store(ckpt_eta_ptr + ck, eta, mask=mask)


@triton.jit
def kla_row(rows_ptr, t, mask):
    """``rows[t]`` (a document's index, or -1) over the program's grid of filters: an int32 block of
    ``mask``'s shape (one scalar load; a block, so that masks combined with it stay boolean blocks)."""
    return tl.load(rows_ptr + t) + tl.zeros(mask.shape, tl.int32)


@triton.jit
def kla_reset(lam, eta, lam0_ptr, eta0_ptr, starts_ptr, t, ms, mask, MS, HAS_INIT: tl.constexpr):
    """Packed documents: where document ``d = starts[t] >= 0`` begins at token ``t``, the state
    ``(lam, eta)`` replaced by row ``d`` of the initial state (offsets ``d * MS + ms``; ``lam = 1,
    eta = 0`` without ``HAS_INIT``), before the token's step; elsewhere unchanged."""
    d = kla_row(starts_ptr, t, mask)
    first = d >= 0
    if HAS_INIT:
        lam0 = tl.load(lam0_ptr + d * MS + ms, mask=mask & first, other=1.0)
        eta0 = tl.load(eta0_ptr + d * MS + ms, mask=mask & first, other=0.0)
    else:
        lam0 = tl.full(mask.shape, 1.0, tl.float32)
        eta0 = tl.zeros(mask.shape, tl.float32)
    return tl.where(first, lam0, lam), tl.where(first, eta0, eta)


@triton.jit
def kla_store_row(x_ptr, y_ptr, x, y, rows_ptr, t, ms, mask, MS):
    """Packed documents: ``x``, ``y`` stored to row ``d = rows[t]`` of two per-document tensors
    (offsets ``d * MS + ms``) where ``d >= 0`` (a document's last token for the final state, its
    first for the initial state's gradients)."""
    d = kla_row(rows_ptr, t, mask)
    keep = mask & (d >= 0)
    tl.store(x_ptr + d * MS + ms, x, mask=keep)
    tl.store(y_ptr + d * MS + ms, y, mask=keep)


@triton.jit
def kla_adjoint_row(gs, ge, mu, glam_ptr, geta_ptr, rows_ptr, t, ms, mask, MS):
    """Packed documents: where document ``d = rows[t]`` ends at token ``t``, the carried adjoints
    ``(gs, ge)`` replaced by its final state's cotangents ``(glam + geta mu, geta)`` (row ``d``,
    ``mu`` the state's mean after ``t``); else unchanged."""
    d = kla_row(rows_ptr, t, mask)
    last = d >= 0
    gl_d = tl.load(glam_ptr + d * MS + ms, mask=mask & last, other=0.0)
    ge_d = tl.load(geta_ptr + d * MS + ms, mask=mask & last, other=0.0)
    return tl.where(last, gl_d + ge_d * mu, gs), tl.where(last, ge_d, ge)
