"""The KLA scan's launch settings: forward and forward+backward times of ``kla_scan_triton``
under several configurations at the model's two shapes (B=8, L=2048 and B=2, L=8192; M=1024, S=16,
float32), queued (:func:`benchmarks.common.timed`), each configuration's outputs and gradients
against the first's (float32 rounding only), and the forward's share of the FP32 rate measured at
the start of the run (``bench_kla.FWD_FP32_OPS`` per state update).

    python -m benchmarks.probes.kla_pieces --out kla_pieces.json
    python -m benchmarks.probes.kla_pieces --out stages.json --configs="-;stages=1;stages=1,bwd_stages=1" --repeat 2

Without ``--configs``: the time split, ``KLAConfig(pieces=, bwd_pieces=, bwd_block_m=)`` over
``DEFAULT_CONFIG``. With it: each ``;``-separated entry is a list of ``field=value`` overrides of
the configuration the layer launches at that shape (``launch_config(..., variance=False)``; ``-``
for none; written ``--configs="-;..."``, since a value starting with ``-`` must follow ``=``), and
``--repeat`` runs the list that many times, alternately forward and reversed, so that drift of the
machine shows.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.bench_kla import FWD_FP32_OPS, fp32_rates, rel
from benchmarks.common import make_inputs, overrides, save, shape_list, timed
from kalmanscan.ops.kla.triton.library import KLAConfig, launch_config
from kalmanscan.ops.kla.triton.backend import kla_scan_triton

CONFIGS = [(None, None, 8), (None, 1, 8), (None, 2, 8), (None, 4, 8), (None, 8, 8), (None, 16, 8), (None, 32, 8),
           (None, 8, 16), (None, 16, 16)]   # (pieces, bwd_pieces, bwd_block_m)


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


def launched(B, L, M, changes):
    """The layer's launch configuration at ``(B, L, M)`` with ``changes`` applied."""
    return dataclasses.replace(launch_config(B, L, M, torch.device("cuda"), variance=False), **changes)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.kla_pieces``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--configs", help="';'-separated field=value overrides of the layer's launch")
    ap.add_argument("--shapes", default="8x2048,2x8192", help="e.g. 2x8192,8x2048")
    ap.add_argument("--repeat", type=int, default=1, help="passes over --configs, alternately reversed")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    rate = fp32_rates()["fp32_instr_per_s"]
    rows = []

    def add(**r):
        r.update(fp32_instr_per_s=rate,
                 fwd_pct_fp32=100.0 * FWD_FP32_OPS * r["B"] * r["L"] * 1024 * 16 / (r["fwd_ms"] * 1e-3) / rate)
        rows.append(r)
        print(r, flush=True)

    for B, L in shape_list(args.shapes):
        xs = make_inputs(B, L, 1024, 16)
        ref = None
        if args.configs is None:
            for pieces, bwd_pieces, block in CONFIGS:
                r, out = row(xs, KLAConfig(pieces=pieces, bwd_pieces=bwd_pieces, bwd_block_m=block), ref)
                ref = ref or out
                add(B=B, L=L, pieces=pieces, bwd_pieces=bwd_pieces, bwd_block_m=block, **r)
            continue
        entries = [e for e in args.configs.split(";") if e.strip()]
        for rep in range(args.repeat):
            for entry in entries if rep % 2 == 0 else entries[::-1]:
                r, out = row(xs, launched(B, L, 1024, overrides(entry)), ref)
                ref = ref or out
                add(B=B, L=L, changes=entry, rep=rep, **r)
    save(args.out, rows)


if __name__ == "__main__":
    main()
