"""``ks.forecast``: k-step-ahead predictive laws of the state and of ``y`` after a filter run.

From the last filtered belief ``N(mu_T, var_T)`` (the smoothed and filtered beliefs coincide at
the last step), the OU transition over a lead time ``L`` (the time since the last observation) is
exact in one step, ``(decay, noise) = discretize(theta, sigma, L)``:

    mean_k = mean + decay_k (mu_T - mean)          var_k = decay_k^2 var_T + noise_k
    obs_mean_k = h mean_k                           obs_var_k = h^2 var_k + obs_var

with ``theta, sigma, mean, h, obs_var`` taken at the last step. This equals running the filter on
``y`` padded with missing values (prediction without updates) to rounding, since OU transitions
compose exactly: ``discretize`` over ``L1 + L2`` is the composition of the two steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kalmanscan.inference.frames import pandas_forecast
from kalmanscan.inference.posterior import Posterior
from kalmanscan.inference.state import array_kind
from kalmanscan.model import ou
from kalmanscan.types import ArrayLike


__all__ = ["forecast", "Forecast"]


@dataclass
class Forecast:
    """Predictive moments at ``K`` future times; every array has shape ``(..., K, C)``.

    - ``mean, var``: the state ``p(x_{T+k} | y_1..y_T)``;
    - ``obs_mean, obs_var``: the observation ``p(y_{T+k} | y_1..y_T)``;
    - ``times``: the absolute future times (float64); ``lead``: the time since the last
      observation (float64).

    Arrays are NumPy or torch tensors, as in the posterior forecast from (tensors stay
    differentiable with respect to the filter's inputs).
    """

    mean: Any
    var: Any
    obs_mean: Any
    obs_var: Any
    times: Any
    lead: Any

    @property
    def std(self) -> Any:
        """Standard deviation of the state forecast."""
        return self.var**0.5

    def __repr__(self) -> str:
        shape = tuple(getattr(self.mean, "shape", ()))
        lead = np.asarray(self.lead.detach().cpu() if hasattr(self.lead, "detach") else self.lead, dtype=np.float64)
        K = shape[-2] if len(shape) >= 2 else 0
        span = f"lead {lead.min():.6g} to {lead.max():.6g} time units after the last observation" if lead.size else ""
        return "\n".join([f"Forecast of K = {K} future times, shape (..., K, C) = {shape}, {array_kind(self.mean)}",
                          "  fields: mean, var, obs_mean, obs_var, times, lead",
                          f"  {span}"]).rstrip()

    @property
    def obs_std(self) -> Any:
        """Standard deviation of the observation forecast."""
        return self.obs_var**0.5

    def interval(self, level: float = 0.9, of: str = "obs") -> tuple[Any, Any]:
        """Central ``level`` interval ``(lower, upper)`` of the ``"obs"`` or ``"state"`` forecast."""
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level!r}")
        if of not in ("obs", "state"):
            raise ValueError(f"of must be 'obs' or 'state', got {of!r}")
        from scipy import stats

        z = float(stats.norm.ppf(0.5 + level / 2))
        m, s = (self.obs_mean, self.obs_std) if of == "obs" else (self.mean, self.std)
        return m - z * s, m + z * s


@pandas_forecast
def forecast(post: Posterior, steps: int | None = None, *, times: ArrayLike | None = None) -> Forecast:
    """Forecast ``steps`` regular steps, or to the given future ``times``, after a filter run.

    Args:
        post: a :class:`~kalmanscan.Posterior` from :func:`kalmanscan.filter` or
            :func:`kalmanscan.smooth` over ``(..., T, C)``.
        steps: number of future steps ``K >= 1``, spaced by the last step's ``dt``.
        times: future absolute times ``(K,)`` or ``(..., K, 1)``, strictly increasing and after
            the last observation time (``post.params["times"][..., -1, :]``; with only ``dt``
            given to the filter, times run from 0 at the first observation).

    Returns:
        :class:`Forecast` with arrays of shape ``(..., K, C)``.

    Raises:
        ValueError: unless ``post`` is a Posterior and exactly one of ``steps`` and ``times`` is
            given, or if they are invalid.
    """
    if not isinstance(post, Posterior):
        raise ValueError(f"post must be the Posterior of ks.filter or ks.smooth, got {type(post).__name__}: "
                         "forecast after a filter run, ks.forecast(ks.filter(y, theta=..., sigma=..., obs_var=...), "
                         "steps=3)")
    if (steps is None) == (times is None):
        raise ValueError("give exactly one of steps and times")
    p = post.params
    last = {k: p[k][..., -1:, :] for k in ("theta", "sigma", "mean", "h", "obs_var", "dt")}
    base = post.filtered if post.filtered is not None else post
    if base.mean is None or base.var is None:
        raise ValueError("post must hold the filtered mean and var (a filter run with outputs including "
                         "'mean' and 'var')")
    mu, var = base.mean[..., -1:, :], base.var[..., -1:, :]
    is_torch = isinstance(mu, torch.Tensor)
    t_last = p["times"][..., -1:, :]
    if is_torch:
        t_last = torch.as_tensor(t_last, dtype=torch.float64, device=mu.device)
    else:
        t_last = np.asarray(t_last, dtype=np.float64)
    if steps is not None:
        if isinstance(steps, (bool, np.bool_)) or not (isinstance(steps, (int, np.integer)) and steps >= 1):
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        k = np.arange(1, steps + 1, dtype=np.float64)[:, None]
        dt_last = last["dt"]  # differentiable: the lead k dt carries dt's gradient
        dt_last = dt_last.to(torch.float64) if is_torch else np.asarray(dt_last, np.float64)
        lead = (torch.as_tensor(k, device=mu.device) if is_torch else k) * dt_last
    else:
        lead = _future_times(times, t_last, is_torch, mu) - t_last
    future = lead + t_last
    L = lead.to(mu.dtype) if is_torch else lead.astype(np.result_type(mu.dtype, np.float64))
    decay, noise = ou.discretize(last["theta"], last["sigma"], L)
    mean = last["mean"] + decay * (mu - last["mean"])
    var_k = decay * decay * var + noise
    moments = dict(mean=mean, var=var_k, obs_mean=last["h"] * mean, obs_var=last["h"] ** 2 * var_k + last["obs_var"])
    if not is_torch:  # computed in float64, returned in the posterior's dtype (as the torch path)
        moments = {k: np.asarray(v).astype(mu.dtype, copy=False) for k, v in moments.items()}
    return Forecast(**moments, times=future, lead=lead)


def _future_times(times, t_last, is_torch, like):
    if is_torch:
        tt = torch.as_tensor(times.detach() if isinstance(times, torch.Tensor) else np.asarray(times, np.float64),
                             dtype=torch.float64, device=like.device)
        finite = bool(torch.isfinite(tt).all())
    else:
        tt = np.asarray(times, dtype=np.float64)
        finite = bool(np.isfinite(tt).all())
    if tt.ndim == 1:
        tt = tt[:, None]
    if tt.ndim < 2 or tt.shape[-1] != 1 or tt.shape[-2] < 1:
        raise ValueError(f"times must have shape (K,) or (..., K, 1) with K >= 1, got {tuple(tt.shape)}")
    if not finite:
        raise ValueError("times must be finite")
    if bool((tt[..., 1:, :] <= tt[..., :-1, :]).any()):
        raise ValueError("times must be strictly increasing")
    if bool((tt[..., :1, :] <= t_last).any()):
        raise ValueError("times must be after the last observation time "
                         f"({float(t_last.max()):g})")
    return tt
