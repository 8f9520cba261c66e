"""Fused forward of the KLA scan (DESIGN.md section 3): the state never leaves registers.

One program per ``(batch b, block of BLOCK_M channels of M)`` holds its ``[BLOCK_M, BLOCK_S]`` grid
of filters ``(lam, eta)`` in registers and walks time sequentially. Per token it reads
``v[b, t, m]``, ``lam_v[b, t, m]``, ``k[b, t, :]``, ``q[b, t, :]`` and applies

    rho = 1 / (decay^2 + noise lam),   lam <- rho lam + lam_v k^2,   eta <- rho decay eta + lam_v v k
    y = sum_s q eta / lam,   y_var = sum_s q^2 / lam      (reduced over s inside the program)

With ``SAVE`` the state at the start of every chunk of ``CHUNK`` tokens is written to
``ckpt_lam/ckpt_eta[b, chunk, m, s]`` for the backward (memory ``B M S L / CHUNK``). The loop is
bound by latency, not arithmetic: ``STAGES`` lets Triton's software pipeliner load tokens ahead
(measured faster than a hand-written register ring), ``UNROLL`` unrolls the time loop.
Float32 arithmetic whatever the input dtype. Every term of the precision update is positive
(``lam > 0`` stays ``> 0``: ``rho lam = lam / (decay^2 + noise lam) > 0``), so nothing cancels in
``lam`` and the divisions are by positive numbers. With ``noise > 0``, ``lam <= 1/noise + max phi``
stays bounded; with ``noise = 0`` and ``decay < 1`` the exact ``lam`` grows like ``decay^(-2t)``.
Padding lanes (``m >= M`` or ``s >= S``) carry ``decay = 1, noise = 0, k = q = 0`` and stay inert.
"""

import triton
import triton.language as tl


@triton.jit
def kla_step(lam, eta, decay, a2, noise, lv, lvv, kt):
    """One predict-then-update step of the ``[BLOCK_M, BLOCK_S]`` filter grid (float32)."""
    rho = 1.0 / (a2 + noise * lam)
    lam = rho * lam + lv[:, None] * (kt * kt)[None, :]
    eta = (rho * decay) * eta + lvv[:, None] * kt[None, :]
    return lam, eta


@triton.jit
def kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, L, M, S, mask_m, mask_s):
    """Float32 ``(lam_v, lam_v v)`` at channels ``row_m`` and ``(k, q)`` of token ``t`` (0 past L)."""
    in_m = mask_m & ((t + tl.zeros_like(row_m)) < L)
    in_s = mask_s & ((t + tl.zeros_like(row_s)) < L)
    lv = tl.load(lam_v_ptr + row_m + t * M, mask=in_m, other=1.0).to(tl.float32)
    vv = tl.load(v_ptr + row_m + t * M, mask=in_m, other=0.0).to(tl.float32)
    kt = tl.load(k_ptr + row_s + t * S, mask=in_s, other=0.0).to(tl.float32)
    qt = tl.load(q_ptr + row_s + t * S, mask=in_s, other=0.0).to(tl.float32)
    return lv, lv * vv, kt, qt


@triton.jit
def kla_tile(pid_m, decay_ptr, noise_ptr, M, S, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Channel/state offsets and masks of program block ``pid_m``, and its ``decay``/``noise``.

    Padding lanes get ``decay = 1, noise = 0`` (an identity predict step).
    """
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BLOCK_S)
    mask_m = offs_m < M
    mask_s = offs_s < S
    mask = mask_m[:, None] & mask_s[None, :]
    ms = offs_m[:, None] * S + offs_s[None, :]
    decay = tl.load(decay_ptr + ms, mask=mask, other=1.0)
    noise = tl.load(noise_ptr + ms, mask=mask, other=0.0)
    return offs_m, offs_s, mask_m, mask_s, mask, ms, decay, noise


@triton.jit
def kla_fwd_kernel(
    v_ptr, lam_v_ptr, k_ptr, q_ptr, decay_ptr, noise_ptr, lam0_ptr, eta0_ptr,
    y_ptr, y_var_ptr, lam_out_ptr, eta_out_ptr, ckpt_lam_ptr, ckpt_eta_ptr,
    L, M, S, n_chunks,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_INIT: tl.constexpr, SAVE: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m, offs_s, mask_m, mask_s, mask, ms, decay, noise = kla_tile(
        pid_m, decay_ptr, noise_ptr, M, S, BLOCK_M, BLOCK_S)
    a2 = decay * decay
    state = pid_b * M * S + ms
    if HAS_INIT:
        lam = tl.load(lam0_ptr + state, mask=mask, other=1.0)
        eta = tl.load(eta0_ptr + state, mask=mask, other=0.0)
    else:
        lam = tl.full((BLOCK_M, BLOCK_S), 1.0, tl.float32)
        eta = tl.zeros((BLOCK_M, BLOCK_S), tl.float32)

    row_m = pid_b * L * M + offs_m
    row_s = pid_b * L * S + offs_s
    for t in tl.range(0, L, num_stages=STAGES, loop_unroll_factor=UNROLL):
        if SAVE:
            if t % CHUNK == 0:
                ck = (pid_b * n_chunks + t // CHUNK) * M * S + ms
                tl.store(ckpt_lam_ptr + ck, lam, mask=mask)
                tl.store(ckpt_eta_ptr + ck, eta, mask=mask)
        lv, lvv, kt, qt = kla_token(v_ptr, lam_v_ptr, k_ptr, q_ptr, row_m, row_s, t, L, M, S,
                                    mask_m, mask_s)
        lam, eta = kla_step(lam, eta, decay, a2, noise, lv, lvv, kt)
        inv = 1.0 / lam
        qi = qt[None, :] * inv
        y = tl.sum(qi * eta, axis=1)
        y_var = tl.sum(qi * qt[None, :], axis=1)
        tl.store(y_ptr + row_m + t * M, y.to(y_ptr.dtype.element_ty), mask=mask_m)
        tl.store(y_var_ptr + row_m + t * M, y_var.to(y_var_ptr.dtype.element_ty), mask=mask_m)
    tl.store(lam_out_ptr + state, lam, mask=mask)
    tl.store(eta_out_ptr + state, eta, mask=mask)
