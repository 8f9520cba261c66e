"""The one table of the filter's parameter bounds and the messages that name them: the host's
NumPy checks, the torch checks and the Triton rows kernel's verdicts all read :data:`BOUNDS`.

Each model parameter must be finite and within its bound (:data:`BOUNDS`, checked in that order);
``init_var`` is required where the stationary law does not exist or is a point.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PARAMS", "BOUNDS", "requirement", "within", "NEEDS_INIT_VAR_THETA", "NEEDS_INIT_VAR_SIGMA"]

PARAMS = ("theta", "sigma", "obs_var", "mean", "h", "dt")
NEEDS_INIT_VAR_THETA = ("init_var is required when theta = 0 (the random walk has no stationary law); "
                         "pass init_var > 0, or float('inf') for a diffuse prior")
NEEDS_INIT_VAR_SIGMA = ("init_var is required where sigma = 0: the stationary variance sigma^2 / (2 theta) "
                         "is then 0 (a known state); pass init_var > 0, or float('inf') for a diffuse prior")

BOUNDS = dict(theta=">= 0", sigma=">= 0", obs_var="> 0", mean=None, h=None, dt="> 0")
"""Each parameter's rule besides being finite (checked in this order)."""


def requirement(bound: str | None) -> str:
    """The words of ``bound``'s rule: ``"finite"`` or ``"finite and > 0"``."""
    return "finite" if bound is None else f"finite and {bound}"


def within(v: np.ndarray | torch.Tensor, bound: str | None) -> np.ndarray | torch.Tensor:
    """Elementwise: ``v`` finite and within ``bound`` (``">= 0"``, ``"> 0"`` or ``None``); NumPy or torch."""
    finite = torch.isfinite(v) if isinstance(v, torch.Tensor) else np.isfinite(v)
    if bound is None:
        return finite
    return finite & ((v >= 0) if bound == ">= 0" else (v > 0))
