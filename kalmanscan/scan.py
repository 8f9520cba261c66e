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

import torch

__all__ = ["associative_scan"]


def associative_scan(combine, elems, dim: int = -2, reverse: bool = False):
    """Inclusive scan of the tuple ``elems`` of tensors along ``dim`` (see module docstring)."""
    elems = tuple(torch.movedim(x, dim, 0) for x in elems)
    if reverse:
        elems = tuple(torch.flip(x, (0,)) for x in elems)
    out = _scan0(combine, elems)
    if reverse:
        out = tuple(torch.flip(x, (0,)) for x in out)
    return tuple(torch.movedim(x, 0, dim) for x in out)


def _scan0(combine, xs):
    n = xs[0].shape[0]
    if n < 2:
        return xs
    pairs = combine(tuple(x[0 : n - 1 : 2] for x in xs), tuple(x[1::2] for x in xs))
    odd = _scan0(combine, pairs)
    head = tuple(o[: (n - 1) // 2] for o in odd)
    even = combine(head, tuple(x[2::2] for x in xs))
    out = []
    for x, e, o in zip(xs, even, odd):
        e = torch.cat([x[:1], e], 0)
        n_pairs = o.shape[0]
        woven = torch.stack([e[:n_pairs], o], 1).reshape((2 * n_pairs,) + o.shape[1:])
        out.append(torch.cat([woven, e[n_pairs:]], 0) if n % 2 else woven)
    return tuple(out)
