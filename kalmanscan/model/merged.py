"""The merged homogeneous form: a stretch of filter steps as 7 numbers, independent of the state it
starts from (docs/math.md). The same algebra runs in the Triton kernels (:mod:`kalmanscan.kernels.filter.fwd`)
and in :mod:`kalmanscan.distributed`.
 Write the precision and information mean as
ratios ``lam = u / w0`` and ``eta = w / w0``. One predict-then-update step with Möbius entries
``(A, B, C, D) = (1 + q phi, a^2 phi, q, a^2)`` (docs/math.md), decay ``a`` and
``b = h r (y - h mean)`` is the linear map

    [u, w0, w] <- [[A,   B,   0],
                   [C,   D,   0],
                   [b C, b D, a]] [u, w0, w]

(``lam' = (A lam + B)/(C lam + D)`` and ``eta' = b + a eta / (C lam + D) = b + f eta``). Products
of such matrices keep the lower block-triangular shape, so a stretch of steps is summarised by 7
numbers per channel ``(A, B, C, D, E, F, G)`` for ``[[A, B, 0], [C, D, 0], [E, F, G]]``, whatever
the state it starts from. The state ``(lam, eta)`` after a summary ``P`` from ``(lam0, eta0)`` is

    lam = (A lam0 + B) / (C lam0 + D),    eta = (E lam0 + F + G eta0) / (C lam0 + D).

Numerics: ``A, B, C, D >= 0`` as in :mod:`kalmanscan.model.mobius`, so the 2x2 block never cancels;
each product is divided by the power of two below the trace ``A + D`` of its 2x2 block (exact; the
ratios ignore it; taken from the detached trace, so gradients pass unchanged). The bottom row is
signed (it carries ``b``) but enters only through ratios with the positive ``C lam0 + D``.

The initial belief becomes a summary too: ``K(lam0, eta0) = [[0, lam0, 0], [0, 1, 0], [0, eta0,
0]]`` maps every state with ``w0 > 0`` to ``(lam0, eta0)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from kalmanscan.model import mobius

Combine = Callable[[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]
"""An associative ``combine(earlier, later)`` on tuples of tensors."""


__all__ = ["leaf", "compose", "total", "chunked_total", "initial", "affine_total", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 22  # elements (steps x filters) per chunk of :func:`chunked_total`


def leaf(decay: torch.Tensor, noise: torch.Tensor, phi: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The 7-tuple of one step per element; arguments broadcast to one shape, ``decay, noise,
    phi >= 0``."""
    A, B, C, D = mobius.leaf(decay, noise, phi)
    return A, B, C, D, b * C, b * D, decay + 0.0 * b


def compose(earlier: tuple[torch.Tensor, ...], later: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``later @ earlier`` for 7-tuples of broadcastable tensors, divided by a power of two.

    The scale is ``2^e`` with ``2^e <= A + D < 2^(e+1)`` for the product's 2x2 block (``A + D >
    0`` for every product of steps and of ``K``), so the product's trace lies in ``[1, 2)``.
    """
    eA, eB, eC, eD, eE, eF, eG = earlier
    lE, lF, lG = later[4:]
    A, B, C, D = mobius.product(earlier[:4], later[:4])
    E = lE * eA + lF * eC + lG * eE
    F = lE * eB + lF * eD + lG * eF
    return mobius.rescale((A, B, C, D, E, F, lG * eG), A + D)


def total(combine: Combine, elems: tuple[torch.Tensor, ...], dim: int) -> tuple[torch.Tensor, ...]:
    """The ordered combination of ``elems[0], ..., elems[n-1]`` along ``dim`` (kept, size 1).

    ``combine(earlier, later)`` is associative on tuples of tensors; the pairwise tree does
    ``n - 1`` combines in ``ceil(log2 n)`` levels and stores ``O(n)`` intermediates for autograd.
    ``elems`` must already have their full length along ``dim``.
    """
    xs = tuple(torch.movedim(x, dim, 0) for x in elems)
    n = xs[0].shape[0]
    while n > 1:
        pairs = combine(tuple(x[0:n - 1:2] for x in xs), tuple(x[1:n:2] for x in xs))
        if n % 2:
            pairs = tuple(torch.cat([p, x[n - 1:]], 0) for p, x in zip(pairs, xs))
        xs, n = pairs, (n + 1) // 2
    return tuple(torch.movedim(x, 0, dim) for x in xs)


def chunked_total(steps: Callable[..., tuple[torch.Tensor, ...]], sliced: Sequence[torch.Tensor], dim: int, width: int,
                  *, chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, ...]:
    """The ordered product over ``dim`` of the step summaries ``steps(i, *parts)``, in chunks.

    ``sliced`` are tensors of one length ``n`` (or 1, passed whole) along ``dim``; chunk ``i``
    passes their slices ``parts`` to ``steps``, which returns the 7-tuple of that chunk's steps.
    Each chunk holds ``max(1, chunk_elements // width)`` steps (``width``: filters per step), is
    reduced by :func:`total`, and the chunk totals are composed in order: memory
    ``O(chunk_elements)``, and under autograd each chunk is recomputed in the backward
    (activation checkpointing) instead of stored. Returns the 7-tuple with ``dim`` of size 1.
    """
    n = max(x.shape[dim] for x in sliced)
    chunk = max(1, chunk_elements // max(1, width))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in sliced)
    result = None
    for i, start in enumerate(range(0, n, chunk)):
        parts = tuple(x if x.shape[dim] == 1 else x.narrow(dim, start, min(chunk, n - start))
                      for x in sliced)
        if grad:
            part = checkpoint(_chunk, steps, i, dim, *parts, use_reentrant=False)
        else:
            part = _chunk(steps, i, dim, *parts)
        result = part if result is None else compose(result, part)
    return result


def _chunk(steps, i: int, dim: int, *parts):
    return total(compose, steps(i, *parts), dim)


def initial(lam0: torch.Tensor, eta0: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The summary ``K`` that sets the state to ``(lam0, eta0)`` (see the module docstring)."""
    zero = torch.zeros_like(lam0 + eta0)
    return zero, lam0 + zero, zero, zero + 1.0, zero, eta0 + zero, zero


def affine_total(f: torch.Tensor, b: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The map ``s -> F s + B`` of the affine steps ``s_t = f_t s_{t+1} + b_t`` along ``dim``,
    applied from the last index back to the first: ``(F, B)`` with ``dim`` kept at size 1."""
    flipped = tuple(torch.flip(x, (dim,)) for x in (f, b))
    return total(mobius.affine_compose, flipped, dim)
