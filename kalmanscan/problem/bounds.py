"""The one table of the filter's parameter bounds and the messages that name them: the host's
NumPy checks, the torch checks and the Triton rows kernel's verdicts
(:mod:`kalmanscan.ops.filter.triton.param_rows`, by :func:`kernel_codes`) all read :data:`BOUNDS`.

Each model parameter must be finite and within its bound (:data:`BOUNDS`, checked in that order);
``init_var`` is required where the stationary law does not exist or is a point. The quantities
derived from them must fit in the data's dtype (float64, or float32 for float32 data): a value
given in float64 that becomes ``inf`` in float32 (:func:`narrowing_message`), the stationary
variance ``sigma^2 / (2 theta)`` (``init_var``'s default, :data:`STATIONARY_OVERFLOW`) and the
process noise ``sigma^2 (1 - exp(-2 theta dt)) / (2 theta)`` (formed as ``sigma^2 dt phi(2 theta
dt)``, :data:`NOISE_OVERFLOW`); past the dtype's largest value the filter's variances would be
``inf`` and its results NaN, so they are refused with a ``ValueError`` naming the parameter and
the limit.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PARAMS", "BOUNDS", "requirement", "within", "kernel_codes", "NEEDS_INIT_VAR_THETA",
           "NEEDS_INIT_VAR_SIGMA", "largest", "narrowing_message", "STATIONARY_OVERFLOW", "NOISE_OVERFLOW",
           "overflow_message"]

PARAMS = ("theta", "sigma", "obs_var", "mean", "h", "dt")
NEEDS_INIT_VAR_THETA = ("init_var is required when theta = 0 (the random walk has no stationary law); "
                         "pass init_var > 0, or float('inf') for a diffuse prior")
NEEDS_INIT_VAR_SIGMA = ("init_var is required where sigma = 0: the stationary variance sigma^2 / (2 theta) "
                         "is then 0 (a known state); pass init_var > 0, or float('inf') for a diffuse prior")

BOUNDS = dict(theta=">= 0", sigma=">= 0", obs_var="> 0", mean=None, h=None, dt="> 0")
"""Each parameter's rule besides being finite (checked in this order)."""

_CODES = {None: 0, ">= 0": 1, "> 0": 2}


def requirement(bound: str | None) -> str:
    """The words of ``bound``'s rule: ``"finite"`` or ``"finite and > 0"``."""
    return "finite" if bound is None else f"finite and {bound}"


def within(v: np.ndarray | torch.Tensor, bound: str | None) -> np.ndarray | torch.Tensor:
    """Elementwise: ``v`` finite and within ``bound`` (``">= 0"``, ``"> 0"`` or ``None``); NumPy or torch."""
    finite = torch.isfinite(v) if isinstance(v, torch.Tensor) else np.isfinite(v)
    if bound is None:
        return finite
    return finite & ((v >= 0) if bound == ">= 0" else (v > 0))


def kernel_codes() -> tuple[int, ...]:
    """:data:`BOUNDS` as the rows kernel's constants, one per parameter in :data:`PARAMS` order:
    0 finite, 1 finite and ``>= 0``, 2 finite and ``> 0``."""
    return tuple(_CODES[BOUNDS[name]] for name in PARAMS)


def largest(dtype: torch.dtype | np.dtype | type) -> float:
    """The largest finite value of a float ``dtype`` (torch or NumPy)."""
    if isinstance(dtype, torch.dtype):
        return float(torch.finfo(dtype).max)
    return float(np.finfo(dtype).max)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.").removeprefix("<class 'numpy.").removesuffix("'>")


def narrowing_message(name: str, dtype: torch.dtype | np.dtype | type) -> str:
    """The error for a finite ``name`` given in a wider dtype that overflows the data's ``dtype``."""
    return (f"{name} must fit in {_name(dtype)}, y's dtype (magnitude at most {largest(dtype):.4g}); "
            "give y in float64, or express y, sigma and obs_var in a larger unit")


STATIONARY_OVERFLOW = ("sigma must be small enough that the stationary variance sigma^2 / (2 theta), init_var's "
                       "default, fits in {dtype} (at most {limit:.4g}); give init_var, or express y, sigma and "
                       "obs_var in a larger unit")
NOISE_OVERFLOW = ("sigma must be small enough that the process noise sigma^2 (1 - exp(-2 theta dt)) / (2 theta) "
                  "fits in {dtype} (formed from sigma^2 dt, at most {limit:.4g}); express y, sigma and obs_var "
                  "in a larger unit")


def overflow_message(template: str, dtype: torch.dtype | np.dtype | type) -> str:
    """:data:`STATIONARY_OVERFLOW` or :data:`NOISE_OVERFLOW` for the data's ``dtype``."""
    return template.format(dtype=_name(dtype), limit=largest(dtype))
