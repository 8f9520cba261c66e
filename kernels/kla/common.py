"""Building blocks shared by the KLA kernels (``kla_fwd``, ``kla_bwd``, ``kla_split``).

A program owns the ``[BLOCK_M, BLOCK_S]`` grid of filters ``(m, s)`` of one batch row; per-channel
token inputs are ``[BLOCK_M]`` vectors, per-state ones ``[BLOCK_S]``. Arithmetic is float32;
reciprocals are the hardware instruction (:func:`kernels.fast_math.rcp`, at most one ulp off).
Padding lanes (``m >= M`` or ``s >= S``) carry ``decay = 1, noise = 0, k = q = 0`` and stay inert.
"""

import triton
import triton.language as tl

from ..fast_math import rcp


@triton.jit
def kla_step_rho(lam, eta, decay, a2, noise, lv, lvv, kt):
    """One predict-then-update step of the filter grid (docs/math.md, section 7):
    ``rho = 1/(decay^2 + noise lam)``, ``lam <- rho lam + lam_v k^2``,
    ``eta <- rho decay eta + lam_v v k``; returns the new ``(lam, eta)`` and ``rho``."""
    rho = rcp(a2 + noise * lam)
    lam_next = rho * lam + lv[:, None] * (kt * kt)[None, :]
    eta_next = (rho * decay) * eta + lvv[:, None] * kt[None, :]
    return lam_next, eta_next, rho


@triton.jit
def kla_step(lam, eta, decay, a2, noise, lv, lvv, kt):
    """:func:`kla_step_rho` without ``rho``."""
    lam, eta, _ = kla_step_rho(lam, eta, decay, a2, noise, lv, lvv, kt)
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
def kla_tile(decay_ptr, noise_ptr, L, M, S, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """The program's batch row ``pid_b`` and channel block ``pid_m`` (grid axes 0 and 1), its
    offsets and masks, ``decay``, ``decay^2`` and ``noise`` of its filters, and the offsets
    ``row_m``/``row_s`` of token 0 of its row in ``(B, L, M)`` and ``(B, L, S)`` tensors.

    Padding lanes get ``decay = 1, noise = 0`` (an identity predict step).
    """
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BLOCK_S)
    mask_m = offs_m < M
    mask_s = offs_s < S
    mask = mask_m[:, None] & mask_s[None, :]
    ms = offs_m[:, None] * S + offs_s[None, :]
    decay = tl.load(decay_ptr + ms, mask=mask, other=1.0)
    noise = tl.load(noise_ptr + ms, mask=mask, other=0.0)
    row_m = pid_b * L * M + offs_m
    row_s = pid_b * L * S + offs_s
    return pid_b, pid_m, offs_m, offs_s, mask_m, mask_s, mask, ms, decay, decay * decay, noise, row_m, row_s


@triton.jit
def kla_map_step(A, B, C, D, x, y, z, decay, a2, noise, lv, lvv, kt):
    """Compose one token's step after the stretch map ``(A, B, C, D, x, y, z)`` (see ``kla_split``).

    The step is the linear map ``[[1 + noise phi, decay^2 phi, 0], [noise, decay^2, 0],
    [b noise, b decay^2, decay]]`` of ``(u, w0, w)`` (``lam = u/w0``, ``eta = w/w0``,
    ``phi = lam_v k^2``, ``b = lam_v v k``). The product is divided by its 2x2 trace ``A + D``
    (positive): the maps act projectively, so the scale is free, and the entries stay in range.
    """
    phi = lv[:, None] * (kt * kt)[None, :]
    b = lvv[:, None] * kt[None, :]
    p1 = 1.0 + noise * phi
    p2 = a2 * phi
    A1 = p1 * A + p2 * C
    B1 = p1 * B + p2 * D
    C1 = noise * A + a2 * C
    D1 = noise * B + a2 * D
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
    ``0 .. pid_p - 1`` (``maps[b, piece, 7, m, s]`` at offsets ``ms``, see ``kla_split``)."""
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
    ``ckpt_lam/ckpt_eta[b, t // CHUNK, m, s]`` (offsets ``ms`` within a batch's ``(M, S)``)."""
    if t % CHUNK == 0:
        ck = (pid_b * n_chunks + t // CHUNK) * M * S + ms
        tl.store(ckpt_lam_ptr + ck, lam, mask=mask)
        tl.store(ckpt_eta_ptr + ck, eta, mask=mask)
