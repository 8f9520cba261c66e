"""The ``"torch"`` backend of the KLA scan: the time-parallel Möbius and affine scans in torch ops.

It materialises ``(B, L, M, S)`` tensors (memory ``O(B L M S)``) and is the differentiable
oracle of the fused ``"triton"`` backend. See :mod:`kalmanscan.ops.kla` for shapes and numerics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kalmanscan.model import merged, mobius
from kalmanscan.model.scan import associative_scan
from kalmanscan.ops.kla.documents import nonempty, token_documents
from kalmanscan.ops.kla.state import FilterState, prepare

__all__ = ["kla_scan", "summary"]


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor,
             initial_state: FilterState | None = None,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, FilterState]:
    """Time-parallel KLA scan in torch ops; returns ``(y, y_var, state)`` in the compute dtype.

    ``initial_state`` is a pair ``(lam, eta)``, a :class:`FilterState` or ``None`` (``lam = 1,
    eta = 0``); ``state`` is a :class:`FilterState`. Differentiable by autograd. The precision
    scan is read out as the variance (:func:`kalmanscan.model.mobius.propagate_var`, from the initial
    variance) and the mean is scanned in mean form (:mod:`kalmanscan.model.mobius`), so ``noise = 0``
    (whose exact precision grows like ``decay^(-2t)``) gives finite outputs and a final ``var``,
    ``mu`` that continue exactly; only the state's pair ``(lam, eta)`` may then be inf.

    Accuracy bound: the read-out ``(C + D var0) / (A + B var0)`` from the initial variance
    ``var0 = 1/lam0`` is differentiated by autograd as a difference of two terms of relative size
    ``1 + phi var0`` (``phi = lam_v k^2``), so the initial state's gradients carry a relative error
    up to about ``eps (1 + phi var0)`` (``eps`` the dtype's rounding): lost in float32 below
    ``lam0 ~ 1e-6``, 1e-4 relative in float64 at ``lam0 = 1e-12``
    (``tests/ops/kla/test_oracle.py``); the cpu and recurrent backends have no such term. Every
    other gradient, and the outputs, are unaffected.

    With ``cu_seqlens`` (:mod:`kalmanscan.ops.kla.documents`) both scans are segmented: a
    document's first token starts a new product (:func:`segmented`), read out from that document's
    initial state, and the final state is read at each document's last token.
    """
    rows = None if cu_seqlens is None else cu_seqlens.numel() - 1
    v, lam_v, k, q, decay, noise, initial_state = prepare(v, lam_v, k, q, decay, noise, initial_state, rows)
    B, L, M = v.shape
    S = k.shape[-1]
    if L == 0:
        empty = v.new_zeros(B, 0, M)
        return empty, empty, initial_state
    shape = (B, L, M, S)
    kk = k.unsqueeze(-2)
    phi = lam_v.unsqueeze(-1) * kk * kk
    b = (lam_v * v).unsqueeze(-1) * kk
    a = decay.expand(shape)
    n = noise.expand(shape)
    var0, mu0 = (x.unsqueeze(1) for x in (initial_state.var, initial_state.mu))
    if cu_seqlens is None:
        scan = associative_scan
        previous = var0
    else:
        doc, first = token_documents(cu_seqlens, L)
        first = first.view(1, L, 1, 1)
        var0, mu0 = (x[doc].unsqueeze(0) for x in (initial_state.var, initial_state.mu))
        previous = var0[:, :1]

        def scan(combine, leaves, dim):
            return associative_scan(segmented(combine), (first, *leaves), dim=dim)[1:]
    P = scan(mobius.compose, mobius.leaf(a, n, phi), dim=1)
    var = mobius.propagate_var(P, var0)
    pred_var = torch.cat([previous, var[:, :-1]], 1)
    if cu_seqlens is not None:
        pred_var = torch.where(first, var0, pred_var)
    pred_var = a * a * pred_var + n
    G, W = scan(mobius.affine_compose, (mobius.mean_gate(a, pred_var, phi), b * var), dim=1)
    mu = G * mu0 + W
    qq = q.unsqueeze(-2)
    y = (qq * mu).sum(-1)
    y_var = (qq * qq * var).sum(-1)
    if cu_seqlens is None:
        return y, y_var, FilterState.from_moments(var[:, -1], mu[:, -1])
    last = (cu_seqlens[1:].long() - 1).clamp(min=0)
    kept = nonempty(cu_seqlens).view(-1, 1, 1)
    final = (torch.where(kept, x[0, last], x0) for x, x0 in ((var, initial_state.var), (mu, initial_state.mu)))
    return y, y_var, FilterState.from_moments(*final)


def segmented(combine: Callable[[tuple, tuple], tuple]) -> Callable[[tuple, tuple], tuple]:
    """The combine of a segmented scan from ``combine`` (:func:`kalmanscan.model.scan.associative_scan`):
    elements carry a leading bool flag, true where a segment starts, and a combination restarts
    from the later element where that is flagged (associative whenever ``combine`` is)."""
    def joined(earlier, later):
        flag, rest = later[0], later[1:]
        both = combine(earlier[1:], rest)
        return (earlier[0] | flag, *(torch.where(flag, x, y) for x, y in zip(rest, both)))
    return joined


def summary(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
            noise: torch.Tensor,
            dtype: torch.dtype, *, chunk_elements: int = merged.CHUNK_ELEMENTS) -> tuple[torch.Tensor, ...]:
    """The product of every token's step, 7 tensors ``(B, M, S)``, in the compute ``dtype``
    (:func:`kalmanscan.model.merged.chunked_total` in chunks of ``chunk_elements`` token-filters:
    memory bounded, recomputed in the backward)."""
    def steps(_, v, lam_v, k, q, decay, noise):
        kk = k.to(dtype).unsqueeze(-2)
        phi = lam_v.to(dtype).unsqueeze(-1) * kk * kk
        b = (lam_v.to(dtype) * v.to(dtype)).unsqueeze(-1) * kk
        a, n = (x.to(dtype).expand(phi.shape) for x in (decay, noise))
        return merged.leaf(a, n, phi, b)

    B, _, M = v.shape
    S = k.shape[-1]
    sliced = (v, lam_v, k, q, decay[None, None], noise[None, None])  # (1, 1, M, S): not sliced
    return tuple(x[:, 0] for x in merged.chunked_total(steps, sliced, 1, B * M * S,
                                                         chunk_elements=chunk_elements))
