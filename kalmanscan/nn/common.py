"""Pieces every mixer shares: RMSNorm, the causal depthwise conv, normalisation, argument checks
and the initialisations of steps and rates."""

from __future__ import annotations

import math
from typing import Any


import torch
from torch import nn

__all__ = ["RMSNorm", "l2_normalize", "scan_dtype", "causal_conv", "empty_sequence", "positive_int", "positive_ints",
           "inner_width", "init_log_dt", "init_log_rates", "heads"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.to(out.dtype)).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``x / max(||x||, eps)`` over the last dimension."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


def scan_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every lower precision (bf16, fp16, fp32) is filtered in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def causal_conv(z: torch.Tensor, window: torch.Tensor | None, conv: nn.Conv1d) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``z`` (B, L, M) continuing the pre-conv ``window`` (B, K - 1, M).

    ``out[t] = bias + sum_j weight[:, j] * padded[t + j]`` with ``padded = [window; z]``, written as
    ``K`` shifted multiply-adds (the same code for a whole sequence and for one decoding step, fast
    in every dtype). Returns the conv output (B, L, M), before its activation, and the new window:
    the last ``K - 1`` rows of ``padded``.
    """
    L, K = z.shape[1], conv.kernel_size[0]
    padded = torch.cat([window.to(z.dtype), z], 1)
    weight = conv.weight[:, 0].to(z.dtype)                      # (M, K)
    out = conv.bias.to(z.dtype) + padded[:, :L] * weight[:, 0]
    for j in range(1, K):
        out = out + padded[:, j:j + L] * weight[:, j]
    return out, padded[:, L:]


def empty_sequence(x: torch.Tensor, state: Any) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """A mixer's result for ``x`` of shape ``(B, 0, D)``: an empty ``y`` of ``x``'s shape, and with
    ``state`` that state unchanged (nothing was read)."""
    y = x.new_zeros(x.shape)
    return y if state is None else (y, state)


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is a positive int, else ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def positive_ints(**values: Any) -> None:
    """:func:`positive_int` for each keyword, in order."""
    for name, value in values.items():
        positive_int(name, value)


def inner_width(d_model: int, expand: float) -> int:
    """``M = expand * d_model``, which must be a positive integer."""
    d_inner = expand * d_model
    if not float(d_inner).is_integer() or d_inner < 1:
        raise ValueError(f"expand * d_model must be a positive integer, got expand={expand!r}")
    return int(d_inner)


def init_log_dt(shape: int | tuple[int, ...], dt_min: float, dt_max: float, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``log dt`` with ``dt`` log-uniform in ``[dt_min, dt_max]`` (Mamba's step initialisation)."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"dt_min, dt_max must satisfy 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
    return torch.empty(shape, device=device, dtype=dtype).uniform_(math.log(dt_min), math.log(dt_max))


def init_log_rates(d_inner: int, d_state: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``log theta`` (M, S) with the S4D-real rates ``theta[m, s] = s + 1``."""
    rates = torch.arange(1, d_state + 1, device=device, dtype=dtype or torch.get_default_dtype())
    return torch.log(rates).expand(d_inner, d_state).clone()


def heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, L, H * d) -> (B, L, H, d)."""
    return x.unflatten(-1, (n_heads, -1))
