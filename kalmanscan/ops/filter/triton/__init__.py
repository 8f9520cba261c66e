"""The ``"triton"`` backend of the toolkit filter and smoother: :mod:`.backend` plans and launches
the kernels of :mod:`kalmanscan.kernels.filter`; :mod:`.library` exposes the differentiable
forward as ``torch.library`` operators; :mod:`.param_rows` checks and derives parameters given as
GPU tensors in one launch; :mod:`.param_adjoints` carries the backward's adjoints to the
parameters; :mod:`.replay` replays small calls from CUDA graphs; :mod:`.config` is the launch
configuration."""

from __future__ import annotations

from kalmanscan.ops.filter.triton.backend import (DEFAULT_CONFIG, FilterConfig, check_device, filter, filter_backward,
                                                  filter_forward, flat, initial_state, kernel_views, plan, replayed,
                                                  smooth, step_flags, stream_step, summary, tile_plan, uses_tiles)

__all__ = ["filter", "smooth", "summary", "filter_forward", "filter_backward", "plan", "tile_plan", "uses_tiles",
           "replayed", "flat", "kernel_views", "check_device", "step_flags", "initial_state",
           "stream_step", "FilterConfig", "DEFAULT_CONFIG"]
