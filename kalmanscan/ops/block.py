"""The elementwise pieces of a sequence model's block for one decoding token, one launch each (the
kernels of :mod:`kalmanscan.kernels.block`; on the CPU through Triton's interpreter).

    s, h = add_rms_norm(x, y, weight, eps)    s = x + y;  h = RMSNorm(s) * weight  (y=None: s = x)
    out = silu_mul(gate_up)                   SiLU(gate) * up of the halves of gate_up (B, 2 H)

The arithmetic of :class:`kalmanscan.nn.common.RMSNorm` after the residual sum and of
:class:`kalmanscan.nn.SwiGLU`'s product, in float32, rounded once to the inputs' dtype (the
residual sum rounded as the model's stream is). Both take ``(B, N)`` rows, allocate their results
and read no value on the host (a step made of them can be captured in a CUDA graph); not
differentiable (decoding only).
"""

from __future__ import annotations

import torch

from kalmanscan.ops.launch import cdiv, next_power_of_2

__all__ = ["add_rms_norm", "silu_mul"]

SILU_BLOCK = 1024


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, h)``: the residual sum ``s = x + y`` (B, N) in ``x``'s dtype and ``h = s / sqrt(mean(s^2)
    + eps) * weight`` in ``x``'s dtype; ``y=None``: ``s`` is ``x`` (the norm alone)."""
    if (y is not None and x.shape != y.shape) or x.ndim != 2 or weight.shape != (x.shape[1],):
        got = None if y is None else tuple(y.shape)
        raise ValueError(f"x, y must be (B, N) of one shape and weight (N,), got {tuple(x.shape)}, {got}, "
                         f"{tuple(weight.shape)}")
    from kalmanscan.kernels.block import add_rms_norm_kernel  # (triton: only where it runs)

    x = x.contiguous()
    s, h = (x, torch.empty_like(x)) if y is None else (torch.empty_like(x), torch.empty_like(x))
    add_rms_norm_kernel[(x.shape[0],)](x, x if y is None else y.contiguous(), weight, s, h, x.shape[1], eps,
                                       BLOCK=next_power_of_2(x.shape[1]), HAS_Y=y is not None)
    return s, h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` (B, H) from ``gate_up = [gate, up]`` (B, 2 H), in its dtype."""
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be (B, 2 H), got {tuple(gate_up.shape)}")
    from kalmanscan.kernels.block import silu_mul_kernel  # (triton: only where it runs)

    gate_up = gate_up.contiguous()
    B, H = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(B, H)
    silu_mul_kernel[(B, cdiv(H, SILU_BLOCK))](gate_up, out, H, BLOCK=SILU_BLOCK)
    return out
