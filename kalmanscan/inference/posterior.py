"""The result object of :func:`kalmanscan.filter` and :func:`kalmanscan.smooth`."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from kalmanscan.inference.state import array_kind, last_state
from kalmanscan.types import ArrayLike


__all__ = ["Posterior", "Params"]


class Params(MutableMapping):
    """``Posterior.params``: a dict whose entries given in ``lazy`` (name -> function of no
    arguments) are computed on first access and then kept, so a call pays only for the
    broadcast parameters, times and counts that are read."""

    def __init__(self, values: dict | None = None, lazy: dict[str, Callable[[], Any]] | None = None):
        self._values = dict(values or {})
        self._lazy = {k: f for k, f in (lazy or {}).items() if k not in self._values}

    def __getitem__(self, key: str) -> Any:
        if key in self._lazy:
            self._values[key] = self._lazy.pop(key)()
        return self._values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._lazy.pop(key, None)
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        if self._lazy.pop(key, None) is None:
            del self._values[key]

    def __iter__(self):
        return iter([*self._values, *self._lazy])

    def __len__(self) -> int:
        return len(self._values) + len(self._lazy)

    def __repr__(self) -> str:
        return f"Params({', '.join(self)})"


@dataclass
class Posterior:
    """Moments of a diagonal Kalman filter (or smoother) run over ``y`` of shape ``(..., T, C)``.

    Every array has the broadcast shape ``(..., T, C)`` of ``y`` and the parameters, except
    ``loglik`` (``(..., C)``: the sum of ``logliks`` over time). Arrays are NumPy when ``y`` was
    NumPy and torch tensors (on ``y``'s device, differentiable) when it was a tensor.

    - ``mean, var, precision``: the filtered belief ``p(x_t | y_1..y_t)`` (smoothed,
      ``p(x_t | y_1..y_T)``, for :func:`kalmanscan.smooth`);
    - ``pred_mean, pred_var, pred_precision``: the one-step prediction ``p(x_t | y_1..y_{t-1})``
      (at ``t = 0`` the initial belief);
    - ``pred_obs_mean, pred_obs_var``: the one-step predictive law of ``y_t``;
    - ``logliks``: ``log p(y_t | y_1..y_{t-1})``, 0 where ``y_t`` is missing; ``loglik`` its sum;
    - from :func:`kalmanscan.filter`, the fields other than ``mean, var, loglik`` are derived from
      those on the first access to any of them, in one pass, and kept (:meth:`defer`);
    - fields left out by ``ks.filter(..., outputs=...)`` are ``None`` (the repr lists them);
    - ``filtered``: for a smoother, the filter's posterior it was computed from (else ``None``);
    - ``params``: the broadcast model inputs (``theta, sigma, obs_var, mean, h, dt, decay, noise``,
      and ``missing``: 1.0 where ``y_t`` was NaN, else 0.0; ``times``: the observation times in
      float64, from 0 in steps of ``dt`` when no ``times`` were given)
      as arrays of the same kind, for forecasting and diagnostics (a :class:`Params` mapping
      from :func:`kalmanscan.filter`: each entry is made on first access);
    - ``frame``: for a pandas ``y``, its labels (:class:`~kalmanscan.inference.frames.FrameLabels`):
      the ``(T, C)`` fields are then DataFrames, ``loglik`` a Series (for a Series ``y``: Series
      and a number; :mod:`kalmanscan.inference.frames`).
    """

    mean: Any
    var: Any
    precision: Any
    pred_mean: Any
    pred_var: Any
    pred_precision: Any
    pred_obs_mean: Any
    pred_obs_var: Any
    logliks: Any
    loglik: Any
    params: MutableMapping = field(default_factory=dict, repr=False)
    filtered: "Posterior | None" = field(default=None, repr=False)
    frame: Any = field(default=None, repr=False)

    def defer(self, names: tuple[str, ...], derive: Callable[[], dict]) -> "Posterior":
        """Leave the fields ``names`` to ``derive`` (no arguments, returning a dict of them), called
        on the first access to any of them, its values then kept: ``self``, its fields ``names``
        unset until then."""
        for k in names:
            self.__dict__.pop(k, None)
        self.__dict__["_deferred"] = (tuple(names), derive)
        return self

    def __getattr__(self, name: str) -> Any:
        deferred = self.__dict__.get("_deferred")
        if deferred is None or name not in deferred[0]:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._settle()
        return self.__dict__[name]

    def _settle(self) -> None:
        """Derive the deferred fields (:meth:`defer`) now, if any are left."""
        deferred = self.__dict__.pop("_deferred", None)
        if deferred is not None:
            names, derive = deferred
            values = derive()
            self.__dict__.update({k: values[k] for k in names})

    def __getstate__(self) -> dict:
        self._settle()
        return self.__dict__

    def _known(self, name: str) -> bool:
        """Whether field ``name`` is computed or deferred (not left out by ``outputs=``)."""
        if name in self.__dict__:
            return self.__dict__[name] is not None
        return name in self.__dict__.get("_deferred", ((),))[0]

    @property
    def std(self) -> Any:
        """Standard deviation of the (filtered or smoothed) belief."""
        return self.var**0.5

    @property
    def n_diffuse(self) -> Any:
        """Observations left out of ``loglik`` per channel, ``(..., C)`` integers: 1 where the
        prior was diffuse (``init_var = inf``) and the channel has an observation (its first: the
        diffuse step, whose density is improper, as statsmodels and KFAS leave it out), else 0."""
        return self.params["n_diffuse"]

    @property
    def state(self) -> Any:
        """The :class:`~kalmanscan.StreamState` at the last step: the filtered mean and variance
        ``(..., C)``, the OU mean level there, the last time (when ``times`` were given) and the
        steps filtered so far; ``ks.filter(next_chunk, ..., state=post.state)`` continues from it."""
        return last_state(self if self.frame is None else self.to_numpy())

    def __repr__(self) -> str:
        kind = "smoother" if self.filtered is not None else "filter"
        names = [f.name for f in fields(self) if f.name not in ("params", "filtered", "frame")]
        some = next((self.__dict__[k] for k in names if self.__dict__.get(k) is not None), None)  # none derived
        shape = tuple(getattr(some, "shape", ()))
        computed = [k for k in names if self._known(k)]
        if kind == "smoother":
            computed.append("filtered (the filter's posterior)")
        arrays = array_kind(some) if self.frame is None else f"pandas {type(some).__name__}"
        lines = [f"Posterior ({kind}) of shape (..., T, C) = {shape}, {arrays}",
                 f"  fields: {', '.join(computed)}"]
        skipped = [k for k in names if not self._known(k)]
        if skipped:
            lines.append(f"  not computed (outputs=): {', '.join(skipped)}")
        if self.loglik is not None:
            lines.append(f"  {loglik_summary(self.loglik)}")
        if self.params:
            lines.append(f"  params: {', '.join(self.params)}")
        return "\n".join(lines)

    def gates(self) -> tuple[Any, Any]:
        """``(forget, write)`` gate traces of the filter, each of shape ``(..., T, C)``.

        ``forget_t = a_t / (a_t^2 + q_t lam_{t-1})`` scales the previous information mean;
        ``write_t = h_t^2 r_t / lam_t`` (the Kalman gain over ``h``) is how much of ``y_t`` is
        written into the state (0 where ``y_t`` is missing). At ``t = 0`` there is no transition
        and ``forget_0 = 1``. DataFrames for a posterior of pandas input.
        """
        if self.frame is not None:
            from kalmanscan.inference.frames import table

            return tuple(table(g, self.frame) for g in self.to_numpy().gates())
        post = self.filtered if self.filtered is not None else self
        p = post.params
        cat = _concat(post.precision)
        lam_prev = cat([post.pred_precision[..., :1, :], post.precision[..., :-1, :]])
        a, q = p["decay"], p["noise"]
        forget = a / (a * a + q * lam_prev)
        forget = cat([forget[..., :1, :] * 0 + 1, forget[..., 1:, :]])
        write = p["h"] ** 2 / p["obs_var"] / post.precision * (1 - p["missing"])
        return forget, write

    def to_numpy(self) -> "Posterior":
        """A copy with every array converted to NumPy (detached, on the host; pandas fields to
        their ``(T, C)`` values, ``loglik`` to ``(C,)``)."""
        conv = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "params":
                v = {k: _to_numpy(x) for k, x in v.items()}
            elif f.name == "filtered":
                v = None if v is None else v.to_numpy()
            elif f.name == "frame":
                v = None
            else:
                v = _to_numpy(v)
                if self.frame is not None and self.frame.series:  # a pandas Series y: (T,) fields, a number loglik
                    v = v.reshape(1) if f.name == "loglik" else v.reshape(-1, 1)
            conv[f.name] = v
        return Posterior(**conv)


def loglik_summary(loglik: ArrayLike) -> str:
    """``"loglik: total -640.99 over 1 series"`` (with the range over series when there are several)."""
    ll = np.asarray(_to_numpy(loglik), dtype=np.float64).reshape(-1)
    if ll.size == 0:
        return "loglik: no series"
    text = f"loglik: total {ll.sum():.6g} over {ll.size} series"
    finite = ll[np.isfinite(ll)]
    if ll.size > 1 and finite.size:
        text += f" (from {finite.min():.6g} to {finite.max():.6g})"
    if finite.size < ll.size:
        text += f", {ll.size - finite.size} not finite"
    return text


def _to_numpy(x):
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _concat(x):
    """Concatenation along time for NumPy arrays or torch tensors."""
    if hasattr(x, "detach"):
        import torch

        return lambda xs: torch.cat(xs, -2)
    return lambda xs: np.concatenate(xs, -2)
