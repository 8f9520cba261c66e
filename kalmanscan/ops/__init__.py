"""The two operations and their backends.

- :mod:`kalmanscan.ops.filter`: the toolkit filter and smoother (``reference``, ``torch``,
  ``triton``, ``cpu``), behind :func:`kalmanscan.filter` and :func:`kalmanscan.smooth`.
- :mod:`kalmanscan.ops.kla`: the KLA scan (``reference``, ``torch``, ``recurrent``, ``triton``),
  behind :func:`kalmanscan.nn.kla_scan`.

Each operation has one registry (``register_backend``) and one module per backend with the same
function names and signatures. The Triton kernels themselves live in :mod:`kalmanscan.kernels`.

The two sub-packages are imported on first use (``kalmanscan.ops.filter``, or ``ks.ops.filter``).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    if name in ("filter", "kla"):
        return importlib.import_module(f"kalmanscan.ops.{name}")
    raise AttributeError(f"module 'kalmanscan.ops' has no attribute {name!r}")
