"""Packed documents in the KLA scan: ``cu_seqlens``, the offsets of ``N`` documents laid end to end.

flash-linear-attention's convention: the batch is one row, ``v`` of shape ``(1, total, M)``, and
``cu_seqlens`` is an int32 tensor ``(N + 1,)`` on ``v``'s device with ``cu_seqlens[0] = 0``,
``cu_seqlens[N] = total`` and non-decreasing entries; document ``d`` is tokens
``cu_seqlens[d] .. cu_seqlens[d + 1] - 1`` (an empty document, two equal offsets, is allowed). At
each document's first token the filters restart from the initial state (``lam = 1, eta = 0``, or
that document's row of an ``(N, M, S)`` initial state), and the final state has one ``(M, S)`` row
per document (an empty document's is its initial state). The result equals one call per document.

The backends that walk time (cpu, triton) read two per-token int32 arrays built here on the device
without a synchronisation (:func:`boundaries`): ``starts[t]``, the document starting at ``t``
(``-1`` elsewhere), and ``ends[t]``, the document ending at ``t``; the time-parallel torch backend
scans within documents (:func:`token_documents`); the reference and the recurrent backends call
themselves once per document (:func:`offsets`, one read of the offsets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kalmanscan.ops.kla.state import FilterState

__all__ = ["check_cu_seqlens", "queue_cu_seqlens", "cu_seqlens_ok", "boundaries", "token_documents", "offsets",
           "nonempty", "validate_cu_seqlens", "each_document"]


def check_cu_seqlens(cu_seqlens: torch.Tensor, v: torch.Tensor) -> int:
    """The host-side checks of ``cu_seqlens`` against ``v`` ``(1, total, M)`` (type, dtype, shape,
    device, one batch row; no value is read); returns the number of documents ``N``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.ndim != 1:
        raise ValueError("cu_seqlens must be a 1-d int32 torch tensor of N + 1 offsets")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold N + 1 >= 2 offsets, got {cu_seqlens.numel()}")
    if cu_seqlens.device != v.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, v is on {v.device}")
    if v.ndim >= 1 and v.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a batch of one row (1, total, ...), v has B = {v.shape[0]}")
    return cu_seqlens.numel() - 1


def queue_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``(first, last, smallest step)`` of the offsets as a float64 ``(3,)`` tensor on their device
    (exact below ``2^53``), queued without waiting: what :func:`cu_seqlens_ok` reads."""
    cu = cu_seqlens.detach().to(torch.float64)
    return torch.cat([cu[:1], cu[-1:], (cu[1:] - cu[:-1]).amin(0, keepdim=True)])


def cu_seqlens_ok(first: float, last: float, step: float, total: int) -> None:
    """``ValueError`` naming ``cu_seqlens`` unless it starts at 0, ends at ``total`` and never
    decreases (the values of :func:`queue_cu_seqlens`)."""
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {first:g}")
    if last != total:
        raise ValueError(f"cu_seqlens must end at the number of tokens {total}, got {last:g}")
    if step < 0:
        raise ValueError("cu_seqlens must be non-decreasing (documents of length >= 0)")


def validate_cu_seqlens(cu_seqlens: torch.Tensor, v: torch.Tensor) -> int:
    """Every check of ``cu_seqlens`` against ``v`` ``(1, total, ...)``, its values read back (one
    synchronisation); returns ``N``."""
    n = check_cu_seqlens(cu_seqlens, v)
    with torch.no_grad():
        cu_seqlens_ok(*queue_cu_seqlens(cu_seqlens).tolist(), v.shape[1])
    return n


def nonempty(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: which documents hold at least one token."""
    return cu_seqlens[1:] > cu_seqlens[:-1]


def boundaries(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, ends)``, int32 ``(total,)``: ``starts[t] = d`` where document ``d`` (non-empty)
    begins at ``t``, ``ends[t] = d`` where it ends at ``t``, ``-1`` elsewhere (device operations
    only, ``total >= 1``). Several documents share an offset only where all but one are empty; the
    largest document index that is non-empty wins (``amax`` over ``-1`` for the empty ones)."""
    cu = cu_seqlens.long()
    doc = torch.where(nonempty(cu_seqlens), torch.arange(cu.numel() - 1, device=cu.device), -1)
    out = []
    for at in (cu[:-1].clamp(max=total - 1), (cu[1:] - 1).clamp(min=0)):
        flags = torch.full((total,), -1, dtype=torch.long, device=cu.device)
        out.append(flags.scatter_reduce_(0, at, doc, "amax").to(torch.int32))
    return out[0], out[1]


def token_documents(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc, first)``: each token's document, int64 ``(total,)``, and whether it is its
    document's first token, bool ``(total,)`` (device operations only; an empty document is
    nobody's: the tokens at a shared offset belong to the last document starting there).

    ``doc`` is the number of offsets at or below ``t``, less one. The search runs over the whole
    offsets tensor, not the view ``cu_seqlens[1:]``: Inductor's Triton lowering of
    ``searchsorted`` has read a sliced sorted sequence from its storage's start
    (https://github.com/pytorch/pytorch/issues/182343), which put every token in the next
    document under ``torch.compile`` on a GPU."""
    t = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens, t, right=True) - 1
    return doc, t == cu_seqlens[doc]


def offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """The offsets as Python integers (one read back)."""
    return cu_seqlens.tolist()


def each_document(scan: Callable[..., tuple[torch.Tensor, torch.Tensor, FilterState]], v: torch.Tensor,
                  lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor, noise: torch.Tensor,
                  initial_state: FilterState,
                  cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, FilterState]:
    """``scan(v, lam_v, k, q, decay, noise, initial_state) -> (y, y_var, state)`` once per document
    (its tokens and its row of ``initial_state``, a :class:`~kalmanscan.ops.kla.state.FilterState`
    of ``N`` rows), the outputs concatenated along time and the final states along their rows."""
    cu = offsets(cu_seqlens)
    ys, y_vars, states = [], [], []
    for d in range(len(cu) - 1):
        a, b = cu[d], cu[d + 1]
        y, y_var, state = scan(v[:, a:b], lam_v[:, a:b], k[:, a:b], q[:, a:b], decay, noise,
                               initial_state.rows(d, d + 1))
        ys.append(y)
        y_vars.append(y_var)
        states.append(state)
    return torch.cat(ys, 1), torch.cat(y_vars, 1), FilterState.cat(states)
