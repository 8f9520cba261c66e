"""The filter's validated inputs and resolved plan, the one type every backend reads and trusts:
:class:`Problem`, made by :func:`kalmanscan.problem.prepare.prepare`; and the output fields a call
may ask for (:data:`OUTPUTS`, checked once by :func:`wanted_outputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kalmanscan.model import mobius, ou
from kalmanscan.model.reciprocal import reciprocal
from kalmanscan.problem.checks import Pending

__all__ = ["Problem", "OUTPUTS", "wanted_outputs"]

OUTPUTS = ("mean", "var", "precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean",
           "pred_obs_var", "logliks", "loglik", "missing")
"""The fields of a filter's :class:`~kalmanscan.Posterior` that ``outputs=`` may name."""


def wanted_outputs(outputs: Sequence[str] | None) -> tuple[str, ...] | None:
    """The fields to compute for ``outputs`` in :data:`OUTPUTS`' order (``"loglik"`` brings
    ``"logliks"``), ``None`` for all; ``ValueError`` naming ``outputs`` for anything else."""
    if outputs is None:
        return None
    if isinstance(outputs, str) or not all(isinstance(k, str) for k in outputs):
        raise ValueError(f"outputs must be a sequence of field names from {OUTPUTS}, got {outputs!r}")
    unknown = sorted(set(outputs) - set(OUTPUTS))
    if unknown or not outputs:
        raise ValueError(f"outputs must name fields from {OUTPUTS}, got {outputs!r}")
    return tuple(k for k in OUTPUTS if k in outputs or (k == "logliks" and "loglik" in outputs))


@dataclass
class Problem:
    """Validated inputs as torch tensors of the compute dtype, broadcastable to ``shape``, and the
    plan of the call: every backend trusts it (no backend checks a value, a name or a shape again).

    ``backend``: the registered backend that runs it (``"auto"`` resolved for ``y``'s device).
    ``y_late``: ``y``'s inf check was left to the caller (:func:`kalmanscan.problem.checks.decide_y`,
    once the kernels are queued): parameters checked on the host, or static device parameters whose
    checks are deferred on the triton backend (the check then comes from the kernels' own pass).

    Facts decided with the checks (no further synchronisation): ``diffuse``, whether any
    ``init_var`` is inf (:mod:`kalmanscan.inference.diffuse`); ``no_noise``, whether some filter with
    ``decay < 1`` has process noise below :data:`kalmanscan.model.mobius.NO_NOISE`
    (:func:`kalmanscan.model.mobius.no_process_noise`; decided with the checks only for the triton
    backend, which picks its path by it; ``None`` otherwise or once a change of the parameters
    made it unknown, and :meth:`no_process_noise` then computes it). ``outputs``: the fields the caller
    asked for (``None``: all; backends may compute more, :func:`kalmanscan.filter` drops them).
    ``derived``: when every parameter came from the host as a scalar or ``(C,)`` (the common call),
    ``decay, noise, lam0, eta0`` computed there in float64 with the checks and moved with the
    parameters in one copy (views ``(1, C)`` of one tensor), and the fields they came from (``from``);
    read through :meth:`decay_noise` and :meth:`initial_info`. ``y_check``: a backend may queue
    ``y``'s inf check with its kernels, returned as ``out["y_check"]`` (a
    :class:`~kalmanscan.problem.checks.Ahead` of a value that is not finite when ``y`` holds an ``inf``,
    read by :func:`kalmanscan.problem.checks.decide_y`); one that does not leaves the caller to check by
    result. ``pending``: checks and facts :func:`prepare` queued without reading them (``defer``):
    the caller decides them once its kernels are queued; ``diffuse`` and ``no_noise`` are then
    guesses until that read confirms them."""

    y: torch.Tensor
    theta: torch.Tensor
    sigma: torch.Tensor
    obs_var: torch.Tensor
    mean: torch.Tensor
    h: torch.Tensor
    dt: torch.Tensor
    init_mean: torch.Tensor
    init_var: torch.Tensor
    shape: tuple
    numpy_out: bool
    out_dtype: object
    times: torch.Tensor | None = None
    diffuse: bool = False
    no_noise: bool | None = None
    outputs: tuple | None = None
    backend: str = "torch"
    y_late: bool = False
    derived: dict | None = field(default=None, repr=False)
    y_check: bool = False
    pending: Pending | None = field(default=None, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.y.dtype

    def no_process_noise(self) -> bool:
        """:attr:`no_noise`, computed (one synchronisation) when unknown."""
        if self.no_noise is None:
            self.no_noise = mobius.no_process_noise(*self.decay_noise())
        return self.no_noise

    def decay_noise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """OU ``(decay, noise)`` per step, broadcastable to ``shape`` (index 0 unused): computed on
        the host with the checks when every parameter came from the host (:attr:`derived`), else
        by :func:`kalmanscan.model.ou.discretize` on the parameters' device."""
        known = self._derived(("theta", "sigma", "dt"))
        if known is not None:
            return known["decay"], known["noise"]
        return ou.discretize(self.theta, self.sigma, self.dt)

    def initial_info(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lam0, eta0)``, each broadcastable to ``shape[:-2] + (1, C)``: the initial precision
        ``1 / init_var`` and information mean ``lam0 (init_mean - mean_0)`` (centred)."""
        known = self._derived(("init_mean", "init_var", "mean"))
        if known is not None:
            return known["lam0"], known["eta0"]
        lam0 = reciprocal(self.init_var)  # its gradient stays in range at any scale of init_var
        return lam0, lam0 * (self.init_mean - self.mean[..., :1, :])

    def _derived(self, sources: tuple[str, ...]) -> dict | None:
        """:attr:`derived` when the fields ``sources`` it was computed from are still this problem's
        (``dataclasses.replace`` of any of them makes it stale), else ``None``."""
        d = self.derived
        if d is None or any(getattr(self, k) is not d["from"][k] for k in sources):
            return None
        return d

    def output(self, x: torch.Tensor) -> torch.Tensor | np.ndarray:
        """Cast a result tensor back to the caller's array kind and dtype."""
        if self.numpy_out:
            return x.detach().cpu().numpy().astype(self.out_dtype, copy=False)
        return x if x.dtype == self.out_dtype else x.to(self.out_dtype)
