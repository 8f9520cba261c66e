"""The ``"recurrent"`` backend of the KLA scan: the filters token by token in mean form.

``L`` steps of ``O(B M S)`` work (:func:`kla_step`, also the decoding step of the layer), autograd
through the loop: fewer operations than the parallel scan, and differentiable twice. The ``"cpu"``
backend (:mod:`kalmanscan.ops.kla.cpu`) runs the same recursion as compiled loops.
"""

from __future__ import annotations

import torch

from kalmanscan.model import mobius
from kalmanscan.ops.kla.documents import each_document
from kalmanscan.ops.kla.state import FilterState, prepare

__all__ = ["kla_scan", "kla_step", "posterior_var"]


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor,
             initial_state: FilterState | None = None,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, FilterState]:
    """The KLA filters token by token in mean form (:func:`kla_step`), in the compute dtype.

    Same arguments and result as :func:`kalmanscan.ops.kla.torch.kla_scan` (with ``cu_seqlens``,
    one call per document: :mod:`kalmanscan.ops.kla.documents`); differentiable by autograd. ``L`` steps
    of O(B M S) work each, against the time-parallel scan's O(log L) levels of 2x2 Möbius products
    with rescaling: several times less arithmetic and memory traffic, so on a CPU it is the faster
    of the two once a step's ``B M S`` elements outweigh the per-step overhead (measured on 2 cores:
    3x at B 4, L 1024, M 128, S 16; 20x at B 64, L 64; 30x slower at B M S = 64, L 4096).
    """
    rows = None if cu_seqlens is None else cu_seqlens.numel() - 1
    v, lam_v, k, q, decay, noise, state = prepare(v, lam_v, k, q, decay, noise, initial_state, rows)
    if cu_seqlens is not None:
        return each_document(kla_scan, v, lam_v, k, q, decay, noise, state, cu_seqlens)
    B, L, M = v.shape
    if L == 0:
        empty = v.new_zeros(B, 0, M)
        return empty, empty, state
    var, mu = state.var, state.mu
    ys, y_vars = [], []
    for t in range(L):
        y, y_var, var, mu = kla_step(v[:, t], lam_v[:, t], k[:, t], q[:, t], decay, noise, var, mu)
        ys.append(y)
        y_vars.append(y_var)
    return torch.stack(ys, 1), torch.stack(y_vars, 1), FilterState.from_moments(var, mu)


def kla_step(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor,
             var: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of the scan in mean form, for decoding: ``(y, y_var, var, mu)``.

    ``v``, ``lam_v`` ``(B, M)``; ``k``, ``q`` ``(B, S)``; ``decay``, ``noise`` ``(M, S)``; the
    variance and mean ``var``, ``mu`` ``(B, M, S)`` before the token and after it; ``y``,
    ``y_var`` ``(B, M)``. With ``phi = lam_v k^2`` and ``pred_var = decay^2 var + noise``:

        var <- pred_var / (1 + phi pred_var),   mu <- g mu + lam_v v k var
        g = decay / (1 + phi pred_var)          (kalmanscan.model.mobius.mean_gate, in [0, decay])
        y = sum_s q mu,   y_var = sum_s q^2 var

    the same filter as the precision recursion of :func:`kalmanscan.ops.kla.reference.kla_scan_sequential`
    (``var = 1/lam``, ``mu = eta/lam``), but without its overflow: with ``noise = 0`` the
    variance and mean only underflow towards their exact limit 0, and a variance of 0 stays 0.
    The variance's update is differentiated by :func:`posterior_var` (exact where ``phi pred_var``
    is large).
    """
    kk = k.unsqueeze(-2)
    phi = lam_v.unsqueeze(-1) * kk * kk
    pred_var = decay * decay * var + noise
    var = posterior_var(pred_var, phi)
    mu = mobius.mean_gate(decay, pred_var, phi) * mu + (lam_v * v).unsqueeze(-1) * kk * var
    qq = q.unsqueeze(-2)
    return (qq * mu).sum(-1), (qq * qq * var).sum(-1), var, mu


def posterior_var(pred_var: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``pred_var / (1 + phi pred_var)`` (broadcast together), whose gradients are taken as
    ``r^2`` and ``-(pred_var r)^2``, ``r = 1 / (1 + phi pred_var)``: autograd of the quotient forms
    ``r - phi pred_var r^2``, which cancels where ``phi pred_var >> 1`` (a large initial variance)
    and lost the initial precision's gradient in float32 (0 against -3.19 at ``lam0 = 1e-12``).
    Differentiable twice."""
    if torch.is_grad_enabled() and (pred_var.requires_grad or phi.requires_grad):
        pred_var, phi = torch.broadcast_tensors(pred_var, phi)
        return _PosteriorVar.apply(pred_var, phi)
    return pred_var / (1.0 + phi * pred_var)


class _PosteriorVar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pred_var, phi):
        ctx.save_for_backward(pred_var, phi)
        return pred_var / (1.0 + phi * pred_var)

    @staticmethod
    def backward(ctx, grad):
        pred_var, phi = ctx.saved_tensors
        r = 1.0 / (1.0 + phi * pred_var)
        return grad * (r * r), -grad * (pred_var * r) ** 2
