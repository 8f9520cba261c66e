"""The registry of the toolkit filter's backends and the dispatch of :func:`kalmanscan.filter` and
:func:`kalmanscan.smooth` to them (the backend contract is in :mod:`kalmanscan.ops.filter`)."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from kalmanscan.problem.problem import Problem
from kalmanscan.ops.registry import Registry

__all__ = ["register_backend", "unregister_backend", "backend_names", "resolve_backend", "get_backend", "run_backend",
           "backend_tensors"]

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
    return _REGISTRY.known(backend)


def get_backend(name: str) -> ModuleType:
    """The module of the registered backend ``name`` (imported on first use)."""
    return _REGISTRY.module(name)


def run_backend(p: Problem, backend: str | None = None) -> dict:
    """Run the backend of ``p``'s plan (:attr:`Problem.backend`), or the one ``backend`` stands
    for, on a validated problem; results as tensors of the compute dtype on ``p``'s device."""
    name = p.backend if backend is None else resolve_backend(backend, p.y.device)
    return backend_tensors(get_backend(name).filter(p), p)


def backend_tensors(out: dict, p: Problem) -> dict[str, torch.Tensor]:
    """A backend's fields as tensors of the compute dtype on ``p``'s device (a registered backend
    may return NumPy arrays)."""
    return {k: torch.as_tensor(v, device=p.y.device).to(p.dtype) if isinstance(v, np.ndarray) else v
            for k, v in out.items()}
