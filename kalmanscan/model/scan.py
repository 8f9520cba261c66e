"""A time-parallel associative scan in torch tensor ops (O(T) work, O(log T) depth).

``associative_scan(combine, elems, dim)`` returns, for every index ``t`` along ``dim``, the
combination of ``elems[0], ..., elems[t]`` in order:

    out[0] = elems[0],   out[t] = combine(out[t-1], elems[t])

``combine(earlier, later)`` takes and returns tuples of tensors (the same structure as ``elems``),
must be associative, and must work elementwise on stacks of elements (it is called on slices along
``dim``). It need not be commutative. With ``reverse=True`` the scan runs from the end:
``out[t] = combine(out[t+1], elems[t])`` with ``out[T-1] = elems[T-1]`` — "earlier" is then the
element later in time, which is what a backward recursion ``s_t = f_t s_{t+1} + b_t`` needs.

The algorithm is the recursive odd/even (Blelloch-style) scan: combine adjacent pairs, scan the
half-length sequence, then fill in the even positions. It does ``< 2T`` combines in ``2 log2 T``
levels, and autograd through it stores ``O(T)`` intermediates (a Hillis–Steele scan would store
``O(T log T)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["associative_scan"]


def associative_scan(combine: Callable[[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
                     elems: tuple[torch.Tensor, ...], dim: int = -2, reverse: bool = False) -> tuple[torch.Tensor, ...]:
    """Inclusive scan of the tuple ``elems`` of tensors along ``dim`` (see module docstring)."""
    elems = tuple(torch.movedim(x, dim, 0) for x in elems)
    if reverse:
        elems = tuple(torch.flip(x, (0,)) for x in elems)
    out = _scan0(combine, elems)
    if reverse:
        out = tuple(torch.flip(x, (0,)) for x in out)
    return tuple(torch.movedim(x, 0, dim) for x in out)


def _deinterleave(x, m: int):
    """x (n, ...) -> ``(x[0:2m:2], x[1:2m:2], x[2m:])`` as split/unbind views: their backward is a
    cat/stack of the gradients, where a strided slice's backward zero-fills a tensor of x's size."""
    body, tail = x.split([2 * m, x.shape[0] - 2 * m])
    even, odd = body.unflatten(0, (m, 2)).unbind(1)
    return even, odd, tail


def _scan0(combine, xs):
    n = xs[0].shape[0]
    if n < 2:
        return xs
    m, k = n // 2, (n - 1) // 2           # pairs; even positions 2, 4, ..., 2k after position 0
    evens, odds, tails = zip(*(_deinterleave(x, m) for x in xs))
    odd = _scan0(combine, combine(evens, odds))                                       # out[1::2]
    firsts, rests = zip(*(e.split([1, m - 1]) for e in evens))
    later = tuple(torch.cat([r, t], 0) for r, t in zip(rests, tails)) if n % 2 else rests
    even = combine(tuple(o.split([k, m - k])[0] for o in odd), later)                 # out[2::2]
    out = []
    for first, e, o in zip(firsts, even, odd):
        e_woven, e_last = torch.cat([first, e], 0).split([m, 1 + k - m])
        woven = torch.stack([e_woven, o], 1).flatten(0, 1)
        out.append(torch.cat([woven, e_last], 0) if n % 2 else woven)
    return tuple(out)
