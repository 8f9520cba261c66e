"""The registry of the toolkit filter's backends and the dispatch of :func:`kalmanscan.filter` and
:func:`kalmanscan.smooth` to them (the backend contract is in :mod:`kalmanscan.ops.filter`)."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import numpy as np
import torch

from kalmanscan.problem.problem import Problem
from kalmanscan.ops.registry import Registry

__all__ = ["register_backend", "unregister_backend", "backend_names", "resolve_backend", "get_backend", "run_backend"]

_REGISTRY = Registry({"reference": "kalmanscan.ops.filter.reference", "torch": "kalmanscan.ops.filter.torch",
                      "triton": "kalmanscan.ops.filter.triton.backend", "cpu": "kalmanscan.ops.filter.cpu.backend"})


def register_backend(name: str, module: str | ModuleType) -> None:
    """Make ``backend=name`` run ``module`` (a module, or its import path, imported on first use),
    which provides ``filter(p)`` and ``smooth(f, mean_param)`` (:mod:`kalmanscan.ops.filter`)."""
    _REGISTRY.register(name, module)


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend` (the built-in ones stay)."""
    _REGISTRY.unregister(name)


def backend_names() -> tuple[str, ...]:
    """The names ``backend`` accepts: ``"auto"`` and every registered backend."""
    return _REGISTRY.names()


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend ``backend`` stands for on ``device``: ``"auto"`` is triton on CUDA, the
    compiled loop (``"cpu"``) on the CPU and torch on any other device; any other registered name
    stands for itself."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu" if device.type == "cpu" else "torch"
    if backend not in backend_names():
        raise ValueError(f"backend must be one of {list(backend_names())}, got {backend!r}")
    return backend


def get_backend(name: str) -> ModuleType:
    """The module of the registered backend ``name`` (imported on first use)."""
    return _REGISTRY.module(name)


def run_backend(p: Problem, backend: str) -> dict:
    """Run the backend ``backend`` stands for on a validated problem; results as tensors of the
    compute dtype on ``p``'s device."""
    out = get_backend(resolve_backend(backend, p.y.device)).filter(_compacted(p))
    return {k: _as_tensor(v, p) for k, v in out.items()}


def _as_tensor(v, p: Problem):
    if isinstance(v, np.ndarray):
        return torch.as_tensor(v, device=p.y.device).to(p.dtype)
    return v


_PARAMETERS = ("theta", "sigma", "obs_var", "mean", "h", "dt", "init_mean", "init_var", "times")


def _compacted(p: Problem) -> Problem:
    """``p`` with each parameter that needs a gradient and is a broadcast view (an expanded
    per-step ``theta``) cut to size 1 along its broadcast dimensions
    (:func:`kalmanscan.ops.filter.torch.compact`): the backends' backward passes then sum its
    adjoint once, and autograd takes it to the view's base."""
    from kalmanscan.ops.filter.torch import compact

    cut = {k: compact(x) for k in _PARAMETERS
           if isinstance(x := getattr(p, k, None), torch.Tensor) and x.requires_grad}
    cut = {k: x for k, x in cut.items() if x is not getattr(p, k)}
    return dataclasses.replace(p, **cut) if cut else p
