"""``1 / x`` whose gradient stays in the floating-point range wherever ``1 / x`` and the gradient do.

torch differentiates ``1 / x`` (``reciprocal`` or a division by ``x``) as ``-g / x^2`` with ``x^2``
formed first: for a variance ``x`` past the square root of the dtype's largest number (``1e154`` in
float64, ``1.8e19`` in float32) ``x^2`` overflows and the gradient comes out 0, and below the square
root of its smallest normal number (``1.5e-154``, ``1.1e-19``) it underflows and the gradient comes
out infinite, though both the value and the true gradient are representable. A filter scaled by
``c`` (``y -> c y``, ``obs_var -> c^2 obs_var``) reaches that at ``c`` of about ``1e77``. Here the
gradient is ``-(g r) r`` with ``r = 1 / x``: ``g r`` is the size of the gradient times ``x``, so every
intermediate lies between the cotangent's, the value's and the gradient's sizes.
"""

from __future__ import annotations

import torch

__all__ = ["reciprocal", "quotient"]


class _Reciprocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return 1.0 / x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        r = reciprocal(x)  # recorded when the backward is (create_graph): differentiable again
        return -(g * r) * r


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` elementwise (the same values as ``1.0 / x``), with the gradient ``-(g r) r``
    (module docstring), itself differentiable the same way (second derivatives); a plain
    division where nothing tracks the gradient."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return 1.0 / x
    return _Reciprocal.apply(x)


class _Quotient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        r = x / y
        ctx.save_for_backward(y, r)
        return r

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, r = ctx.saved_tensors
        return quotient(g, y), -quotient(g * r, y)


def quotient(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x / y`` elementwise (the same values), with the gradients ``g / y`` and ``-(g (x / y)) / y``:
    torch's ``-g x / y^2`` forms ``y^2``, which underflows for ``y`` below ``1.5e-154`` (float64) and
    overflows above ``1e154``, though ``x / y`` and the gradient are representable (module docstring);
    ``y`` may be subnormal, where ``1 / y`` itself overflows. Differentiable again the same way; a
    plain division where nothing tracks the gradient."""
    if not (torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)):
        return x / y
    return _Quotient.apply(x, y)
