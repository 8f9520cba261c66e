"""The exchange of stretch summaries over ranks: incoming states from the gathered summaries.

Each rank summarises its stretch in the merged form (:mod:`kalmanscan.model.merged`); rank 0's summary
includes the initial belief ``K(lam0, eta0)`` (:func:`kalmanscan.model.merged.initial`). Rank 0 sends
``P_0 K``; the exclusive prefix ``P_{r-1} ... P_0 K`` then holds rank ``r``'s incoming state in its
middle column: ``lam = B / D``, ``eta = F / D``.
"""

from __future__ import annotations

import torch


from kalmanscan.model.merged import compose

__all__ = ["incoming", "incoming_moments"]


def incoming(gathered: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lam, eta)`` entering rank ``rank`` from the stacked summaries ``(world, 7, ...)``.

    ``gathered[0]`` must include the initial belief (rank 0 sends ``P_0 K``); ``rank >= 1``.
    The exclusive prefix over ranks is composed in rank order (``rank - 1`` combines).
    """
    _, B, _, D, _, F, _ = _prefix(gathered, rank)
    return B / D, F / D


def incoming_moments(gathered: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(var, mu)`` entering rank ``rank``: :func:`incoming` read as the variance ``D / B`` and
    the mean ``F / B``, which stay in range when the precision ``B / D`` would not (no process
    noise, docs/math.md)."""
    _, B, _, D, _, F, _ = _prefix(gathered, rank)
    return D / B, F / B


def _prefix(gathered, rank: int):
    """The exclusive prefix ``P_{rank-1} ... P_0 K`` of the stacked summaries (``rank - 1``
    combines, in rank order)."""
    prefix = tuple(gathered[0].unbind(0))
    for j in range(1, rank):
        prefix = compose(prefix, tuple(gathered[j].unbind(0)))
    return prefix
