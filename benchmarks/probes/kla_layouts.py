"""The KLA scan's two grid orientations: ``DEFAULT_CONFIG`` (a channel's states across lanes)
against ``SPLIT_CONFIG`` (each thread one channel's states), which ``launch_config`` picks where
time is split, timed alternately in one process with the public call beside them.

    python -m benchmarks.probes.kla_layouts --out kla_layouts.json

Shapes: ``M = 1024, S = 16``, float32, 16384 tokens a call (``B x L``): (1, 16384), (2, 8192),
(4, 4096), (8, 2048). For each, the kernels with each configuration (``kla_scan_triton``, queued,
forward and forward+backward: :func:`benchmarks.probes.kla_pieces.row`) in the order default, split,
the chosen one without ``y_var`` (``variance=False``, as the layer runs it), the same without the
kernels' bounds masks (``KLAConfig.even``) twice, without ``y_var`` again,
split, default, and the public ``kla_scan(backend="triton")`` (input checks, then
``launch_config``'s choice: :func:`benchmarks.bench_kla.bench_triton`). The forward's share of the
FP32 rate measured in the same run is printed with each row (``bench_kla.FWD_FP32_OPS`` per state
update), and each configuration's outputs and gradients are compared with the default's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from benchmarks.bench_kla import FWD_FP32_OPS, bench_triton, fp32_rates
from benchmarks.common import make_inputs, shape_list
from benchmarks.probes.kla_pieces import row
from kalmanscan.ops.kla.triton.library import DEFAULT_CONFIG, SPLIT_CONFIG, launch_config

SHAPES = [(1, 16384), (2, 8192), (4, 4096), (8, 2048)]
M, S = 1024, 16


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.kla_layouts``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES), help="e.g. 2x8192,8x2048")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    rate = fp32_rates()["fp32_instr_per_s"]
    result = dict(device=torch.cuda.get_device_name(), fp32_instr_per_s=rate, rows=[])

    def add(**r):
        if "fwd_ms" in r:
            r["fwd_pct_fp32"] = 100.0 * FWD_FP32_OPS * r["B"] * r["L"] * M * S / (r["fwd_ms"] * 1e-3) / rate
        result["rows"].append(r)
        print(r, flush=True)

    for B, L in shape_list(args.shapes):
        xs = make_inputs(B, L, M, S)
        chosen = "split" if launch_config(B, L, M, xs[0].device) == SPLIT_CONFIG else "default"
        ref = None
        configs = dict(default=DEFAULT_CONFIG, split=SPLIT_CONFIG,
                       no_variance=launch_config(B, L, M, xs[0].device, variance=False))
        configs["even"] = dataclasses.replace(configs["no_variance"], even=True)
        order = ("default", "split", "no_variance", "even", "even", "no_variance", "split", "default")
        for name in order:
            timing, out = row(xs, configs[name], ref)
            ref = ref or out
            add(B=B, L=L, config=name, chosen=chosen, **timing)
        public = bench_triton((B, L, M, S), None, rate, public=True)
        add(B=B, L=L, config="public kla_scan", chosen=chosen, fwd_ms=public["fwd_ms"],
            fwd_bwd_ms=public["fwd_bwd_ms"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
