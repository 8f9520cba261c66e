"""The ``"triton"`` backend of the KLA scan: :mod:`.backend` launches the fused kernels of
:mod:`kalmanscan.kernels.kla` through the ``torch.library`` operators of :mod:`.library`."""

from __future__ import annotations

from kalmanscan.ops.kla.triton.backend import DEFAULT_CONFIG, KLAConfig, kla_scan, kla_scan_triton, summary

__all__ = ["kla_scan", "kla_scan_triton", "summary", "KLAConfig", "DEFAULT_CONFIG"]
