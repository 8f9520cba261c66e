"""Uninitialised tensors whose first touch is cheap on a CPU.

Fresh memory is mapped by the kernel page by page on first write; in 4 KiB pages that can cost
more than the loop or copy that fills it. NumPy asks the kernel for huge pages for large arrays,
so on a CPU the tensors here are NumPy's, shared with torch without a copy (the cpu backend's
outputs, and the fields :func:`kalmanscan.inference.diffuse.run_finite` joins).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["empty"]

_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised tensor of ``shape``: allocated by NumPy for a float32 or float64 CPU tensor,
    by torch otherwise."""
    if torch.device(device).type == "cpu" and dtype in _NUMPY:
        return torch.from_numpy(np.empty(tuple(shape), _NUMPY[dtype]))
    return torch.empty(tuple(shape), dtype=dtype, device=device)
