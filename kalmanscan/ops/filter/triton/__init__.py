"""The ``"triton"`` backend of the toolkit filter and smoother: :mod:`.backend` plans and launches
the kernels of :mod:`kalmanscan.kernels.filter`; :mod:`.library` exposes the differentiable
forward as ``torch.library`` operators; :mod:`.param_rows` checks and derives parameters given as
GPU tensors in one launch; :mod:`.derive` writes the Posterior fields derived from the filtered
moments in one launch; :mod:`.param_adjoints` carries the backward's adjoints to the parameters;
:mod:`.replay` replays small calls from CUDA graphs; :mod:`.config` is the launch configuration.

The names below are :mod:`.backend`'s, imported on first use: importing a module of this package
(the CPU path imports :mod:`.param_rows`) imports triton only where a kernel is needed."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["filter", "smooth", "summary", "filter_forward", "filter_backward", "plan", "tile_plan", "uses_tiles",
           "replayed", "flat", "kernel_views", "check_device", "step_flags", "initial_state",
           "stream_step", "FilterConfig", "DEFAULT_CONFIG"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kalmanscan.ops.filter.triton.backend"), name)
    raise AttributeError(f"module 'kalmanscan.ops.filter.triton' has no attribute {name!r}")
