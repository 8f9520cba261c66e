"""The KLA scan's time split for few sequences: forward and forward+backward times of
``kla_scan_triton`` under several ``KLAConfig(pieces=, bwd_pieces=, bwd_block_m=)`` at the
model's two shapes (B=8, L=2048 and B=2, L=8192; M=1024, S=16, float32), queued
(:func:`benchmarks.bench_kla.timed`), each configuration's outputs and gradients against the
default's (float32 rounding only).

    python -m benchmarks.kla_pieces --out kla_pieces.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import torch

from benchmarks.bench_kla import make_inputs, rel, timed
from kalmanscan.ops.kla import triton as kla_triton
from kalmanscan.ops.kla.library import KLAConfig
from kalmanscan.ops.kla.triton import kla_scan_triton

CONFIGS = [(None, None, 8), (None, 1, 8), (None, 2, 8), (None, 4, 8), (None, 8, 8), (None, 16, 8), (None, 32, 8),
           (None, 8, 16), (None, 16, 16)]   # (pieces, bwd_pieces, bwd_block_m)


@contextlib.contextmanager
def unmasked():
    """Inside, the scan's launch configurations drop the kernels' bounds masks where the blocks
    are full (``KLAConfig.even``, off by default)."""
    original = kla_triton.launch_config
    kla_triton.launch_config = lambda *args, **kwargs: dataclasses.replace(original(*args, **kwargs), even=True)
    try:
        yield
    finally:
        kla_triton.launch_config = original


def row(xs, config, ref):
    """Forward and forward+backward milliseconds of ``kla_scan_triton`` with ``config``, the outputs
    and gradients of ``sum y + sum y_var`` (``sum y`` for a config without the variance), and
    their largest relative difference from ``ref`` (``y`` alone for a config without it)."""
    leaves = [x.clone().requires_grad_() for x in xs]

    def forward():
        with torch.no_grad():
            kla_scan_triton(*xs, config=config)

    def loss(y, y_var):
        return y.sum() if y_var is None else y.sum() + y_var.sum()

    def forward_backward():
        y, y_var, _, _ = kla_scan_triton(*leaves, config=config)
        torch.autograd.grad(loss(y, y_var), leaves)

    y, y_var, _, _ = kla_scan_triton(*leaves, config=config)
    grads = torch.autograd.grad(loss(y, y_var), leaves)
    out = [y.detach(), *(() if y_var is None else (y_var.detach(),)), *grads]
    if ref is None:
        err = 0.0
    else:
        err = rel(y, ref[0]) if y_var is None else max(rel(a, b) for a, b in zip(out, ref))
    return dict(fwd_ms=timed(forward), fwd_bwd_ms=timed(forward_backward), rel_vs_default=err), out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for B, L in ((8, 2048), (2, 8192)):
        xs = make_inputs(B, L, 1024, 16)
        ref = None
        for pieces, bwd_pieces, block in CONFIGS:
            r, out = row(xs, KLAConfig(pieces=pieces, bwd_pieces=bwd_pieces, bwd_block_m=block), ref)
            ref = ref or out
            rows.append(dict(B=B, L=L, pieces=pieces, bwd_pieces=bwd_pieces, bwd_block_m=block, **r))
            print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
