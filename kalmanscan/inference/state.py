"""The filter's belief at the last step of a call (:class:`StreamState`), which a later call
continues (:mod:`kalmanscan.inference.stream`), and :func:`last_state`, which reads it off a
Posterior."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kalmanscan.types import ArrayLike

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior

__all__ = ["StreamState", "last_state", "array_kind"]


@dataclass(frozen=True, eq=False)
class StreamState:
    """The filter's belief at the last step of a call, which ``ks.filter(..., state=)`` continues.

    Attributes:
        mean: filtered mean ``(..., C)`` at the last step (uncentred, as ``post.mean``).
        var: its variance ``(..., C)``, ``>= 0`` (0 a known state, which the filter reaches without
            process noise); ``inf`` where nothing was observed yet under a diffuse prior
            (``init_var = inf``).
        level: the OU mean level (the ``mean`` argument) at the last step, ``(..., C)``.
        time: the last step's time ``(..., 1)`` (float64) when the call had ``times``, else ``None``;
            a chunk given ``times`` must start after it.
        steps: steps filtered so far, over every call of the stream.

    Arrays are NumPy or torch tensors, as the posterior it came from (tensors stay differentiable).
    Not to be confused with :class:`kalmanscan.ops.kla.FilterState`, the KLA layer's ``(lam, eta)``.
    """

    mean: Any
    var: Any
    level: Any = 0.0
    time: Any = None
    steps: int = 0

    def __post_init__(self):
        if not isinstance(self.steps, (int, np.integer)) or self.steps < 0:
            raise ValueError(f"state.steps must be an integer >= 0, got {self.steps!r}")
        shapes = [tuple(np.shape(getattr(self, k))) for k in ("mean", "var", "level")]
        try:
            np.broadcast_shapes(*shapes)
        except ValueError:
            raise ValueError(f"state.mean, state.var and state.level of shapes {shapes} do not broadcast "
                             "together") from None

    def __repr__(self) -> str:
        shape = tuple(getattr(self.mean, "shape", ()))
        time = "" if self.time is None else f", last time {float(np.max(_host(self.time))):.6g}"
        return (f"StreamState of shape (..., C) = {shape}, {array_kind(self.mean)}, "
                f"after {self.steps} steps{time}")


def array_kind(x: ArrayLike) -> str:
    """``"float64, NumPy"`` or ``"torch.float32 on cuda:0, requires grad"``: an array's dtype and device."""
    if hasattr(x, "detach"):
        return f"{x.dtype} on {x.device}" + (", requires grad" if x.requires_grad else "")
    return f"{np.asarray(x).dtype}, NumPy"


def last_state(post: Posterior) -> StreamState:
    """The :class:`StreamState` at the last step of ``post`` (a smoother's is its filter's: the
    two coincide there). The state holds no view of the chunk's arrays beyond its last step, nor of
    the caller's."""
    base = post.filtered if post.filtered is not None else post
    if base.mean is None or base.var is None:
        raise ValueError("state needs the filtered mean and var: call ks.filter with outputs including "
                         "'mean' and 'var'")
    params = post.params
    T = base.mean.shape[-2]
    time = None
    if bool(params.get("times_given", False)):
        time = _own(params["times"][..., -1, :1], 0)
    steps = int(params.get("steps_before", 0)) + T
    return StreamState(mean=_own(base.mean[..., -1, :], T), var=_own(base.var[..., -1, :], T),
                       level=_own(params["mean"][..., -1, :], 0), time=time, steps=steps)


def _own(x: Any, T: int) -> Any:
    """``x`` (the last step of a ``T``-step array) not sharing memory with more than one step of
    it: copied unless ``T == 1``; the level and time (``T = 0``) always, as they may view the
    caller's own ``mean`` or ``times``, which may be updated in place (an optimiser's step)."""
    if hasattr(x, "detach"):  # a tensor
        return x if T == 1 else x.clone()
    return np.array(x)


def _host(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
