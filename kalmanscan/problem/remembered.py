"""Checked parameter values remembered by what they were made from.

A loop of calls with the same parameters (a fitted model run over new data, a benchmark) would check
and convert them again each call: on a GPU that is host work (NumPy checks, a copy to page-locked
memory and to the device) longer than the kernels of a small call. :class:`Remembered` keeps what
such a call made, keyed by :func:`value_key` of each value given on the host (its exact contents)
and the layout of everything else; a repeated call reads it back. Only what nothing returned to
the caller shares is kept (the callers copy it, or read it into new tensors).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import numpy as np
import torch

from kalmanscan.types import ArrayLike

__all__ = ["Remembered", "value_key", "KEYED_SIZE"]

KEYED_SIZE = 4096
"""The largest array value (elements) keyed by its bytes; a larger one is not remembered."""


def value_key(x: ArrayLike | None) -> tuple | None:
    """A key of a value given on the host, equal exactly when the values are: the type and
    ``repr`` of ``None`` or a Python number; the dtype, shape and bytes of an array or CPU tensor
    (as float64) of at most :data:`KEYED_SIZE` elements. ``None`` when it is larger or not
    numeric (not remembered)."""
    if x is None or isinstance(x, (bool, int, float)):
        return type(x), repr(x)
    if isinstance(x, torch.Tensor):
        if x.numel() > KEYED_SIZE:
            return None
        x = x.detach().to(torch.float64).numpy()
    x = np.asarray(x)
    if x.size > KEYED_SIZE or x.dtype.kind not in "biuf":
        return None
    return x.dtype.str, x.shape, x.tobytes()


class Remembered:
    """At most ``size`` results by key (all dropped when full); thread-safe."""

    def __init__(self, size: int):
        self.size, self._items, self._lock = size, {}, threading.Lock()

    def get(self, key: Hashable | None, make: Callable[[], object]) -> object:
        """The result kept for ``key``, else ``make()`` (kept unless ``key`` is ``None``; nothing
        is kept when ``make`` raises)."""
        if key is None:
            return make()
        with self._lock:
            found = self._items.get(key)
        if found is None:
            found = make()
            with self._lock:
                if len(self._items) >= self.size:
                    self._items.clear()
                self._items[key] = found
        return found

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Forget every result."""
        with self._lock:
            self._items.clear()
