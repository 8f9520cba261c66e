"""The ``"cpu"`` backend of the toolkit filter and smoother: compiled (numba) loops over time,
parallel over series. :mod:`.backend` holds the backend's functions, :mod:`.loops` the forward,
:mod:`.adjoint` its reverse recursion, :mod:`.rts` the smoother, :mod:`.stream` one step;
:mod:`.small` the same operations without numba for small float64 work."""

from __future__ import annotations

from kalmanscan.ops.filter.cpu.backend import (FIELDS, INPUTS, POSTERIOR, SMOOTH_INPUTS, filter, layout, smooth,
                                               stream_step, stream_step_arrays)

__all__ = ["filter", "smooth", "stream_step", "stream_step_arrays", "layout", "FIELDS", "POSTERIOR", "INPUTS",
           "SMOOTH_INPUTS"]
