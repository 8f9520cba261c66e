"""The KLA scan's registry of backends, its input validation and its dispatch (:func:`kla_scan`);
the operation is described in :mod:`kalmanscan.ops.kla`."""

from __future__ import annotations

import math
import os
from types import ModuleType


import torch

from ... import mobius
from ..registry import Registry
from .state import FilterState

__all__ = ["kla_scan", "register_backend", "unregister_backend", "backend_names", "validate", "RECURRENT_MIN_WIDTH"]

RECURRENT_MIN_WIDTH = 4096   # B * M * S from which "auto" scans CPU tensors token by token

_REGISTRY = Registry({name: f"kalmanscan.ops.kla.{name}"
                       for name in ("reference", "torch", "recurrent", "triton")})


def register_backend(name: str, module: ModuleType) -> None:
    """Make ``kla_scan(..., backend=name)`` call ``module.kla_scan(v, lam_v, k, q, decay, noise,
    initial_state) -> (y, y_var, state)`` (a module, or its import path imported on first use)."""
    _REGISTRY.register(name, module)


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend` (the built-in ones stay)."""
    _REGISTRY.unregister(name)


def backend_names() -> tuple[str, ...]:
    """The names ``backend`` accepts: ``"auto"`` and every registered backend."""
    return _REGISTRY.names()


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor, *,
             initial_state: FilterState | None = None, return_state: bool = False,
             backend: str = "auto") -> tuple[torch.Tensor, ...]:
    """Run the KLA filters over the sequence (see the module docstring for shapes and numerics).

    Returns ``(y, y_var)``, or ``(y, y_var, state)`` with the final :class:`FilterState` (it
    unpacks as ``(lam, eta)``) when ``return_state`` is true. ``initial_state`` is a pair
    ``(lam, eta)`` of ``(B, M, S)`` tensors with ``lam > 0``, or a :class:`FilterState` (continued
    from its ``var`` and ``mu``). ``backend`` is ``"torch"`` (the time-parallel scan),
    ``"triton"``, ``"recurrent"`` (:func:`kla_scan_recurrent`, token by token) or ``"auto"``: triton
    for CUDA tensors; on a CPU recurrent where a token's ``B M S`` filters number at least
    :data:`RECURRENT_MIN_WIDTH` (there it is several times faster), torch otherwise.
    Filters with ``decay < 1`` and no process noise (``noise``
    below :data:`kalmanscan.mobius.NO_NOISE`), and initial states whose variance is below it, run
    on the torch backend when ``backend`` is triton: their precision is past the range of the fused
    kernels, which carry it, while the torch backend scans the variance and the mean. Raises
    ``ValueError`` naming the offending argument.
    """
    mean_form = validate(v, lam_v, k, q, decay, noise, initial_state, backend)
    if backend == "auto":
        wide = v.shape[0] * v.shape[2] * k.shape[-1] >= RECURRENT_MIN_WIDTH
        backend = "triton" if v.is_cuda else "recurrent" if v.device.type == "cpu" and wide else "torch"
    if backend == "triton" and mean_form:
        backend = "torch"
    module = _REGISTRY.module(backend)
    y, y_var, state = module.kla_scan(v, lam_v, k, q, decay, noise, initial_state)
    y, y_var = y.to(v.dtype), y_var.to(v.dtype)
    return (y, y_var, state) if return_state else (y, y_var)


def validate(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor,
             initial_state: FilterState | None, backend: str) -> bool:
    """Check shapes, dtypes, devices and value ranges; return whether the filters need the mean
    form of the torch backend (a precision past the fused kernels' range, see :func:`kla_scan`)."""
    if backend not in backend_names():
        raise ValueError(f"backend must be one of {backend_names()}, got {backend!r}")
    named = dict(v=v, lam_v=lam_v, k=k, q=q, decay=decay, noise=noise)
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point torch tensor")
        if x.device != v.device:
            raise ValueError(f"{name} is on {x.device}, v is on {v.device}")
    if v.ndim != 3:
        raise ValueError(f"v must have shape (B, L, M), got {tuple(v.shape)}")
    B, L, M = v.shape
    if lam_v.shape != v.shape:
        raise ValueError(f"lam_v must have v's shape {tuple(v.shape)}, got {tuple(lam_v.shape)}")
    if k.ndim != 3 or k.shape[:2] != (B, L):
        raise ValueError(f"k must have shape (B, L, S) = ({B}, {L}, S), got {tuple(k.shape)}")
    S = k.shape[2]
    if q.shape != k.shape:
        raise ValueError(f"q must have k's shape {tuple(k.shape)}, got {tuple(q.shape)}")
    for name in ("decay", "noise"):
        if named[name].shape != (M, S):
            raise ValueError(f"{name} must have shape (M, S) = ({M}, {S}), got {tuple(named[name].shape)}")
    if backend == "triton" and not v.is_cuda and not _interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1)")
    ranges = [("lam_v", lam_v, lambda lo, hi: lo > 0 and hi < math.inf, "positive and finite"),
              ("decay", decay, lambda lo, hi: lo > 0 and hi <= 1, "in (0, 1]"),
              ("noise", noise, lambda lo, hi: lo >= 0 and hi < math.inf, "finite and >= 0")]
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError("initial_state must be a pair (lam, eta) of (B, M, S) tensors")
        for name, x in (("initial_state lam", initial_state[0]), ("initial_state eta", initial_state[1])):
            if not isinstance(x, torch.Tensor) or x.shape != (B, M, S) or x.device != v.device:
                raise ValueError(f"{name} must be a ({B}, {M}, {S}) tensor on {v.device}")
        if isinstance(initial_state, FilterState):
            ranges.append(("initial_state var", initial_state.var,
                           lambda lo, hi: lo >= 0 and hi < math.inf, "finite and >= 0"))
        else:
            ranges.append(("initial_state lam", initial_state[0],
                           lambda lo, hi: lo > 0 and hi < math.inf, "positive and finite"))
    ranges = [r for r in ranges if r[1].numel()]
    mean_form = False
    if ranges and not (v.is_cuda and torch.cuda.is_current_stream_capturing()):
        # One reduction per tensor and a single device-to-host copy (NaN fails every comparison);
        # the last row is the smallest noise among decaying filters (see kalmanscan.mobius).
        with torch.no_grad():
            rows = [torch.stack(torch.aminmax(x.detach())).double() for _, x, _, _ in ranges]
            rows.append(torch.stack(torch.aminmax(mobius.decaying_noise(decay, noise))).double())
            extrema = torch.stack(rows).tolist()
        smallest = extrema[-1][0]
        for (name, _, ok, what), (lo, hi) in zip(ranges, extrema):
            if not ok(lo, hi):
                raise ValueError(f"{name} must be {what}")
            if name == "initial_state var":  # a precision the noise bound 1/NO_NOISE exceeds
                smallest = min(smallest, lo)
        mean_form = mobius.precision_overflows(smallest, noise.dtype)
    return mean_form


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
