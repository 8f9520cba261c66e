"""The caller's values as arrays and tensors of the compute dtype, on the device, and the shapes
they broadcast to (the rules of :mod:`kalmanscan.problem.prepare`)."""

from __future__ import annotations

import numpy as np
import torch

from kalmanscan.problem.bounds import narrowing_message
from kalmanscan.types import ArrayLike

__all__ = ["on_host", "host_array", "to_device", "broadcast_param", "broadcast_init"]


def on_host(x: ArrayLike | None) -> bool:
    """Whether ``x`` is ``None``, or a scalar or ``(C,)`` given on the host without gradient: the
    parameters :func:`_prepare_host` takes."""
    if x is None or isinstance(x, (int, float)):
        return True
    if isinstance(x, torch.Tensor):
        return x.device.type == "cpu" and x.ndim <= 1 and not x.requires_grad
    return np.ndim(x) <= 1


def host_array(name: str, x: ArrayLike, np_dtype: type) -> np.ndarray:
    """``x`` as a NumPy array of the compute dtype (then float64, exactly): what the kernels see.
    ``ValueError`` naming ``name`` when a finite value overflows the compute dtype."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to(torch.float64).numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):
        out = arr.astype(np_dtype, copy=False)
    if out.dtype != arr.dtype and arr.dtype.kind == "f" and (np.isinf(out) & np.isfinite(arr)).any():
        raise ValueError(narrowing_message(name, np_dtype))
    return out.astype(np.float64, copy=False)


def to_device(x: torch.Tensor, device: torch.device, copy: bool = False) -> torch.Tensor:
    """``x`` on ``device`` (differentiably; a new tensor with ``copy``). From the CPU to a GPU
    through page-locked memory without blocking: torch waits for the device's queue after a copy
    from pageable memory, so a call that moved a host value that way would not queue behind the
    previous call. The page-locked source is never written, so the copy may read it late. Under
    ``torch.compile``, which cannot trace page-locking, a plain copy. A copy on the CPU of a
    tensor needing no gradient is NumPy's, on this thread: torch's copy of a few hundred kB wakes
    its thread pool, which on a busy machine waits for a time slice."""
    if device.type == "cuda" and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return (x if x.is_pinned() else x.pin_memory()).to(device, non_blocking=True)
    if (copy and device.type == "cpu" and x.device.type == "cpu" and not x.requires_grad
            and not torch.compiler.is_compiling()):
        return torch.from_numpy(x.numpy().copy())
    return x.to(device, copy=copy)


def broadcast_param(name: str, shape: tuple, pshape: tuple, T: int) -> tuple:
    try:
        out = np.broadcast_shapes(shape, pshape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {pshape} does not broadcast with shape {shape} "
            "(static parameters are scalars or (C,); per-step ones are (..., T, C))") from None
    if out[-2] != T:
        raise ValueError(f"{name} of shape {pshape} has a time axis of length {pshape[-2]}, but y has T = {T}")
    return out


def broadcast_init(name: str, shape: tuple, pshape: tuple) -> tuple:
    """``shape`` broadcast with an initial-state parameter of shape ``pshape`` (``(..., 1, C)``)."""
    try:
        batch = np.broadcast_shapes(shape[:-2] + (1, shape[-1]), pshape)
    except ValueError:
        raise ValueError(f"{name} of shape {pshape} does not broadcast to {shape[:-2] + (shape[-1],)}") from None
    return batch[:-2] + shape[-2:-1] + batch[-1:]
