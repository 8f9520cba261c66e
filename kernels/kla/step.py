"""One decoding token of the KLA block (docs/math.md, section 3), fused around its projections.

The block's step is ``in_proj -> conv step -> sensor_proj -> filter step -> out_proj``: the
sensor projection reads the whole conv output of a batch row, so the conv and the filter are two
launches with a matrix product between them.

:func:`kla_conv_step_kernel`: per ``(batch b, block of channels)``, the causal depthwise conv of
width ``K`` over ``[window; z]`` and its SiLU, and the window shifted by one token::

    out[m] = silu(bias[m] + sum_{j < K-1} weight[m, j] window[j, m] + weight[m, K-1] z[m])
    window <- [window[1:]; z]

:func:`kla_step_kernel`: per ``(batch b, block of BLOCK_M channels)``, the sensor post-processing,
the filter update of the ``[BLOCK_M, S]`` grid of the state in mean form (variance ``var``, mean
``mu``), the read-out and the gated output::

    lam_v = 1 / (softplus(log_var + bias) + floor)      k, q <- k / ||k||, q / ||q||
    phi = lam_v k^2,   pred_var = decay^2 var + noise
    var <- pred_var / (1 + phi pred_var),   mu <- decay / (1 + phi pred_var) mu + lam_v v k var
    y = sum_s q mu,   y_var = sum_s q^2 var
    out = (y + skip z) silu(gate)

the predict-then-update of the scan (``lam = 1/var``, ``eta = mu/var``), in the form whose state
only underflows towards its exact limit 0 without process noise. Arithmetic is float32 (the
wrappers run float64 in torch operations); every division is by a number ``>= 1`` or by
``softplus + floor > 0``; ``||k||`` is floored at ``eps``.
Padding lanes load ``k = q = 0``, ``decay = noise = var = mu = 0`` and stay finite. Each program
reads its part of the state before writing it, so the state may be updated in place
(``var_out_ptr == var_ptr``); likewise the conv window.
"""

import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """``log(1 + exp(x))`` as ``max(x, 0) + log1p(exp(-|x|))``, with ``log1p(u) = log(w) u / (w - 1)``
    for ``w = 1 + u`` (exact to a few ulps where ``u`` is below the rounding of 1)."""
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.maximum(x, 0.0) + log1p


@triton.jit
def unit(x_ptr, offs_s, mask_s, eps):
    """The ``[BLOCK_S]`` row at ``x_ptr`` divided by ``max(||x||, eps)`` (zero in padding lanes)."""
    x = tl.load(x_ptr + offs_s, mask=mask_s, other=0.0).to(tl.float32)
    return x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), eps)


@triton.jit
def kla_conv_step_kernel(
    # pointers
    z_ptr, window_ptr, weight_ptr, bias_ptr, window_out_ptr, out_ptr,
    # dimensions and strides (rows of z and out; the window is (B, K - 1, M) contiguous)
    M, stride_z, stride_out,
    # meta-parameters
    K: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_b = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    z = tl.load(z_ptr + pid_b * stride_z + offs_m, mask=mask_m, other=0.0)
    acc = tl.load(bias_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    acc += tl.load(weight_ptr + offs_m * K + (K - 1), mask=mask_m, other=0.0).to(tl.float32) * z.to(tl.float32)
    window = window_ptr + pid_b * (K - 1) * M + offs_m
    window_out = window_out_ptr + pid_b * (K - 1) * M + offs_m
    for j in tl.static_range(K - 1):
        w_j = tl.load(weight_ptr + offs_m * K + j, mask=mask_m, other=0.0).to(tl.float32)
        acc += w_j * tl.load(window + j * M, mask=mask_m, other=0.0).to(tl.float32)
    tl.debug_barrier()  # every read of the window precedes its update (it may be updated in place)
    for j in tl.static_range(K - 2):
        row = tl.load(window + (j + 1) * M, mask=mask_m, other=0.0)
        tl.store(window_out + j * M, row, mask=mask_m)
    if K > 1:
        tl.store(window_out + (K - 2) * M, z.to(window_out_ptr.dtype.element_ty), mask=mask_m)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + pid_b * stride_out + offs_m, out.to(out_ptr.dtype.element_ty), mask=mask_m)


@triton.jit
def kla_step_kernel(
    # pointers: the token's projections (rows of any float dtype)
    v_ptr, log_var_ptr, k_ptr, q_ptr, z_ptr, gate_ptr,
    # pointers: parameters
    decay_ptr, noise_ptr, skip_ptr, bias_ptr,
    # pointers: the state (B, M, S) before and after the token (may alias), the outputs (B, M)
    var_ptr, mu_ptr, var_out_ptr, mu_out_ptr, out_ptr, y_var_ptr,
    # dimensions, row strides, constants
    M, S, stride_v, stride_log_var, stride_k, stride_q, stride_z, stride_gate, stride_skip, stride_out,
    floor, eps,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, HAS_BIAS: tl.constexpr, VAR: tl.constexpr,
):
    pid_b = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BLOCK_S)
    mask_m, mask_s = offs_m < M, offs_s < S
    mask = mask_m[:, None] & mask_s[None, :]
    ms = offs_m[:, None] * S + offs_s[None, :]
    state = pid_b * M * S + ms

    k = unit(k_ptr + pid_b * stride_k, offs_s, mask_s, eps)
    q = unit(q_ptr + pid_b * stride_q, offs_s, mask_s, eps)
    log_var = tl.load(log_var_ptr + pid_b * stride_log_var + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        log_var += tl.load(bias_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    lam_v = 1.0 / (softplus(log_var) + floor)
    v = tl.load(v_ptr + pid_b * stride_v + offs_m, mask=mask_m, other=0.0).to(tl.float32)

    decay = tl.load(decay_ptr + ms, mask=mask, other=0.0)
    noise = tl.load(noise_ptr + ms, mask=mask, other=0.0)
    var = tl.load(var_ptr + state, mask=mask, other=0.0)
    mu = tl.load(mu_ptr + state, mask=mask, other=0.0)
    phi = lam_v[:, None] * (k * k)[None, :]
    pred_var = decay * decay * var + noise
    denom = 1.0 + phi * pred_var
    var = pred_var / denom
    mu = decay / denom * mu + (lam_v * v)[:, None] * k[None, :] * var
    tl.store(var_out_ptr + state, var, mask=mask)
    tl.store(mu_out_ptr + state, mu, mask=mask)

    y = tl.sum(q[None, :] * mu, axis=1)
    if VAR:
        y_var = tl.sum((q * q)[None, :] * var, axis=1)
        tl.store(y_var_ptr + pid_b * M + offs_m, y_var, mask=mask_m)
    z = tl.load(z_ptr + pid_b * stride_z + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + pid_b * stride_gate + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    skip = tl.load(skip_ptr + offs_m * stride_skip, mask=mask_m, other=0.0).to(tl.float32)
    out = (y + skip * z) * (gate * tl.sigmoid(gate))
    tl.store(out_ptr + pid_b * stride_out + offs_m, out.to(out_ptr.dtype.element_ty), mask=mask_m)
