"""The ``"cpu"`` backend of the KLA scan: :mod:`.backend` (the autograd function and its
checkpoints) over the compiled loops of :mod:`.loops`."""

from __future__ import annotations

from kalmanscan.ops.kla.cpu.backend import CHUNK, kla_scan, kla_scan_cpu, kla_scan_cpu_backward

__all__ = ["kla_scan", "kla_scan_cpu", "kla_scan_cpu_backward", "CHUNK"]
