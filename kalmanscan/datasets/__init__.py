"""Small datasets bundled with kalmanscan, and simulation from the model.

- :func:`load_nile`: annual flow of the Nile at Aswan, 1871–1970 (10^8 m^3), the classic
  local-level example (public domain; Durbin and Koopman, *Time Series Analysis by State Space
  Methods*).
- :func:`sensors`: a synthetic noisy multi-sensor series with gaps and irregular times.
- :func:`simulate`: draw a latent OU path and noisy observations from the filter's own model.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np

from kalmanscan.model import ou
from kalmanscan.types import ArrayLike


__all__ = ["load_nile", "sensors", "simulate", "Dataset"]


@dataclass
class Dataset:
    """A time series ``y`` of shape ``(T, C)`` with its ``times`` ``(T,)`` and channel names.

    ``truth`` (the latent state, ``(T, C)``) and ``params`` (the model that generated it) are set
    for synthetic data and ``None`` for real data. ``time_unit`` names the unit of ``times``.
    """

    name: str
    times: np.ndarray
    y: np.ndarray
    channels: tuple
    time_unit: str
    truth: np.ndarray | None = None
    params: dict | None = None


def load_nile() -> Dataset:
    """The Nile flow series: ``times`` are years 1871..1970, ``y`` has shape ``(100, 1)``."""
    text = resources.files(__package__).joinpath("nile.csv").read_text()
    rows = np.array([line.split(",") for line in text.strip().splitlines()[1:]], dtype=float)
    return Dataset(name="nile", times=rows[:, 0], y=rows[:, 1:2], channels=("volume",), time_unit="year")


def simulate(theta: ArrayLike, sigma: ArrayLike, obs_var: ArrayLike, *, T: int | None = None,
             times: ArrayLike | None = None, dt: ArrayLike = 1.0, mean: ArrayLike = 0.0, h: ArrayLike = 1.0,
             init_mean: ArrayLike | None = None, init_var: ArrayLike | None = None,
             seed: int | np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``(x, y)`` of shape ``(T, C)`` from the OU state-space model of :func:`kalmanscan.filter`.

    Parameters are static, broadcasting to ``(C,)``. Give ``T`` (regular steps ``dt``) or ``times``
    ``(T,)``. The initial state is drawn from ``N(init_mean, init_var)`` (default: ``mean`` and the
    stationary variance). Float64, reproducible from ``seed``.
    """
    rng = np.random.default_rng(seed)
    if times is not None:
        times = np.asarray(times, dtype=float)
        steps = np.diff(times)
        T = times.shape[0]
    elif T is None:
        raise ValueError("T or times is required")
    else:
        steps = np.full(T - 1, float(dt))
    theta, sigma, obs_var, mean, h = np.broadcast_arrays(
        *(np.atleast_1d(np.asarray(v, float)) for v in (theta, sigma, obs_var, mean, h)))
    C = theta.shape[-1]
    m0 = mean if init_mean is None else np.broadcast_to(np.asarray(init_mean, float), (C,))
    if init_var is None:
        if np.any(theta == 0):
            raise ValueError("init_var is required when theta = 0")
        init_var = ou.stationary_var(theta, sigma)
    v0 = np.broadcast_to(np.asarray(init_var, float), (C,))
    x = np.empty((T, C))
    x[0] = m0 + np.sqrt(v0) * rng.standard_normal(C)
    for t in range(1, T):
        decay, noise = ou.discretize(theta, sigma, steps[t - 1])
        x[t] = mean + decay * (x[t - 1] - mean) + np.sqrt(noise) * rng.standard_normal(C)
    y = h * x + np.sqrt(obs_var) * rng.standard_normal((T, C))
    return x, y


def sensors(T: int = 400, seed: int = 0) -> Dataset:
    """Three noisy sensors of one slowly drifting quantity each, irregular times, gaps.

    Times are seconds with exponential spacing (mean 1 s). Sensor noise differs by channel
    (``obs_var = 0.05, 0.2, 0.8``); each channel has a long dropout and scattered missing values
    (NaN). ``truth`` is the latent state; ``params`` the generating model.
    """
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0, T)) + 0.5
    params = dict(theta=np.array([0.02, 0.05, 0.1]), sigma=np.array([0.3, 0.4, 0.5]),
                  obs_var=np.array([0.05, 0.2, 0.8]), mean=np.array([20.0, 5.0, -3.0]))
    x, y = simulate(times=times, seed=seed + 1, **params)
    for c in range(3):
        start = rng.integers(T // 5, 4 * T // 5 - T // 10)
        y[start:start + T // 10, c] = np.nan
        y[rng.random(T) < 0.05, c] = np.nan
    return Dataset(name="sensors", times=times, y=y, channels=("temperature", "pressure", "level"),
                   time_unit="s", truth=x, params=params)
