"""One decoding token of the KLA block around its projections: the conv step and the filter step.

    z_pre, gate = in_proj(x)                              (B, M) each
    z, window = conv_step(z_pre, window, weight, bias)    conv of width K over [window; z_pre], SiLU
    v, log_var, k, q = the sensor projection of z         (B, M), (B, M), (B, S), (B, S)
    out, y_var, var, mu = kla_decode_step(v, log_var, k, q, z, gate, decay, noise, skip, bias, var, mu)
    y = out_proj(out)

:func:`kla_decode_step` post-processes the sensors (``lam_v = 1 / (softplus(log_var + bias) +
floor)``, ``k`` and ``q`` L2-normalised), applies predict-then-update to the ``(B, M, S)`` filters
in mean form (:func:`kalmanscan.ops.kla.recurrent.kla_step`: variance ``var``, mean ``mu``), reads
``y`` and ``y_var`` out and returns the gated ``out = (y + skip z) SiLU(gate)``.

Backends: ``"triton"`` launches the kernels of :mod:`kalmanscan.kernels.kla.step` (one each,
float32 arithmetic), ``"torch"`` runs the same arithmetic in torch operations (any device and
float dtype, differentiable when no output buffer is given) and ``"auto"`` picks triton for CUDA
tensors; float64 runs in torch operations whatever the backend. Results go into the given
buffers (``window_out``, ``var_out``, ``mu_out``, ``out``; the state's own tensors for an update
in place) or new tensors: a step with buffers launches nothing but its kernels and reads no value
on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kalmanscan.ops.kla.recurrent import kla_step
from kalmanscan.ops.launch import cdiv, next_power_of_2

__all__ = ["conv_step", "kla_decode_step", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")
NORM_EPS = 1e-12     # the floor of ||k||, ||q|| in the normalisation
BLOCK_M = 32         # channels a program of the filter step owns (a [32, S] grid of filters)
CONV_BLOCK_M = 128   # channels a program of the conv step owns


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    """The kernel for ``"triton"``, and for ``"auto"`` on CUDA; float64 always in torch operations."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return x.dtype != torch.float64 and (backend == "triton" or (backend == "auto" and x.is_cuda))


def _rows(*xs: torch.Tensor) -> None:
    """``ValueError`` unless each (B, N) tensor has unit stride along N (a column slice of a
    projection's output is fine)."""
    for x in xs:
        if x.ndim != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
            raise ValueError(f"token inputs must be (B, N) rows with unit column stride, got shape "
                             f"{tuple(x.shape)} and strides {x.stride()}")


def _writable(name: str, buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``buffer`` checked against ``like`` (shape, dtype, contiguity), or a new tensor like it."""
    if buffer is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if buffer.shape != like.shape or buffer.dtype != like.dtype or not buffer.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {like.dtype} tensor of shape {tuple(like.shape)}, got "
                         f"{buffer.dtype} {tuple(buffer.shape)} (contiguous: {buffer.is_contiguous()})")
    return buffer


def conv_step(z: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              window_out: torch.Tensor | None = None, out: torch.Tensor | None = None,
              backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the causal depthwise conv and its SiLU: ``(out, window_out)``.

    ``z`` (B, M) the pre-conv input, ``window`` (B, K - 1, M) the previous ``K - 1`` of them,
    ``weight`` (M, K), ``bias`` (M,). ``out[m] = SiLU(bias[m] + sum_{j < K-1} weight[m, j]
    window[j, m] + weight[m, K-1] z[m])`` in ``z``'s dtype (float32 arithmetic in the kernel, the
    dtype's own in torch operations, as the block's forward), and ``window_out = [window[1:]; z]``
    (may be ``window`` itself).
    """
    _rows(z)
    B, M = z.shape
    K = weight.shape[-1]
    if window.shape != (B, K - 1, M) or weight.shape != (M, K) or bias.shape != (M,):
        raise ValueError(f"window, weight, bias must have shapes {(B, K - 1, M)}, {(M, K)}, {(M,)}, got "
                         f"{tuple(window.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    window_out = _writable("window_out", window_out, window)
    out = _writable("out", out, z)
    if _use_triton(backend, window):
        from kalmanscan.kernels.kla.step import kla_conv_step_kernel  # (triton: only where it runs)

        window = window.contiguous()
        kla_conv_step_kernel[(B, cdiv(M, CONV_BLOCK_M))](
            z, window, weight.contiguous(), bias, window_out, out, M, z.stride(0), out.stride(0),
            K=K, BLOCK_M=CONV_BLOCK_M,
        )
        return out, window_out
    padded = torch.cat([window.to(z.dtype), z[:, None]], 1)            # (B, K, M)
    weight = weight.to(z.dtype)
    acc = bias.to(z.dtype) + padded[:, 0] * weight[:, 0]
    for j in range(1, K):
        acc = acc + padded[:, j] * weight[:, j]
    out.copy_(F.silu(acc))
    window_out.copy_(padded[:, 1:])
    return out, window_out


def kla_decode_step(v: torch.Tensor, log_var: torch.Tensor, k: torch.Tensor, q: torch.Tensor, z: torch.Tensor,
                    gate: torch.Tensor, decay: torch.Tensor, noise: torch.Tensor, skip: torch.Tensor,
                    obs_var_bias: torch.Tensor | None, var: torch.Tensor, mu: torch.Tensor, *,
                    floor: float, variance: bool = False, var_out: torch.Tensor | None = None,
                    mu_out: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The filter step of one token: ``(out, y_var, var_out, mu_out)``.

    Args:
        v, log_var: (B, M) the value and the log observation variance (before ``obs_var_bias``).
        k, q: (B, S) the key and query, not yet normalised.
        z, gate: (B, M) the conv output (the skip's input) and the output gate before its SiLU.
        decay, noise: (M, S) the OU prior over one token, in the state's dtype.
        skip: the skip ``D_skip``, () or (M,). obs_var_bias: (M,) or ``None``.
        var, mu: (B, M, S) the filters' variance and mean before the token.
        floor: the observation-variance floor (``lam_v <= 1 / floor``).
        variance: also return ``y_var`` (B, M) in the state's dtype (else ``None``).
        var_out, mu_out, out: buffers for the new state (may be ``var``, ``mu``: in place) and
            for ``out`` (B, M, ``z``'s dtype); new tensors where ``None``.

    The token inputs may be column slices of a projection's output (unit column stride); any
    float dtype (read as float32 by the kernel). Without buffers the torch backend is
    differentiable with respect to every input.
    """
    _rows(v, log_var, k, q, z, gate)
    B, M = v.shape
    S = k.shape[1]
    if var.shape != (B, M, S) or mu.shape != var.shape or decay.shape != (M, S) or noise.shape != (M, S):
        raise ValueError(f"var, mu must have shape {(B, M, S)} and decay, noise {(M, S)}, got "
                         f"{tuple(var.shape)}, {tuple(mu.shape)}, {tuple(decay.shape)}, {tuple(noise.shape)}")
    if _use_triton(backend, var):
        from kalmanscan.kernels.kla.step import kla_step_kernel  # (triton: only where it runs)

        var_out, mu_out = _writable("var_out", var_out, var), _writable("mu_out", mu_out, var)
        out = _writable("out", out, z)
        y_var = torch.empty(B, M, dtype=var.dtype, device=var.device) if variance else var_out
        bias = obs_var_bias if obs_var_bias is not None else skip
        kla_step_kernel[(B, cdiv(M, BLOCK_M))](
            v, log_var, k, q, z, gate, decay.to(var.dtype).contiguous(), noise.to(var.dtype).contiguous(), skip, bias,
            var.contiguous(), mu.contiguous(), var_out, mu_out, out, y_var,
            M, S, v.stride(0), log_var.stride(0), k.stride(0), q.stride(0), z.stride(0), gate.stride(0),
            0 if skip.ndim == 0 else skip.stride(0), out.stride(0), floor, NORM_EPS,
            BLOCK_M=BLOCK_M, BLOCK_S=next_power_of_2(S), HAS_BIAS=obs_var_bias is not None, VAR=variance,
        )
        return out, y_var if variance else None, var_out, mu_out
    dtype = var.dtype
    log_var = log_var.to(dtype)
    if obs_var_bias is not None:
        log_var = log_var + obs_var_bias.to(dtype)
    lam_v = 1.0 / (F.softplus(log_var) + floor)
    k, q = (x.to(dtype) / torch.linalg.vector_norm(x.to(dtype), dim=-1, keepdim=True).clamp_min(NORM_EPS)
            for x in (k, q))
    y, y_var, var_new, mu_new = kla_step(v.to(dtype), lam_v, k, q, decay, noise, var, mu)
    gated = (y.to(z.dtype) + skip.to(z.dtype) * z) * F.silu(gate)
    results = []
    for buffer, value, name in ((out, gated, "out"), (var_out, var_new, "var_out"), (mu_out, mu_new, "mu_out")):
        results.append(value if buffer is None else _writable(name, buffer, value).copy_(value))
    return results[0], y_var if variance else None, results[1], results[2]
