"""Launch sweep of the chunked forward (:mod:`kalmanscan.kernels.filter.chunks`) beside the walks and
accelerated-scan, in one process. A script, not a test.

    python -m benchmarks.chunk_sweep --out chunks.json

At each shape of ``--shapes`` (``CxT``, comma-separated) and fraction of missing values of
``--missing``: the forward writing the filtered mean and variance (12 bytes per element) with the
walks (``DEFAULT_CONFIG`` with ``chunks`` off) and with the chunks under every launch of
:data:`LAUNCHES` (rows, steps, channels per program, warps), each checked first against the
float64 walks on the same inputs (worst relative error of mean and variance); accelerated-scan's
Triton recurrence at the same shape when installed. CUDA-graph medians (ms) and % of the copy
bandwidth measured in the same run. Results are written after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks.bench_filter import copy_bandwidth, graph_ms
from benchmarks.bench_recurrence import FWD_BYTES, accelerated_scan, check, problem
from benchmarks.records import commit
from kalmanscan.ops.filter import triton as triton_backend
from kalmanscan.ops.filter.config import DEFAULT_CONFIG

LAUNCHES = [(8, 16, 32, 8), (8, 16, 32, 4), (8, 16, 16, 4), (8, 8, 32, 8), (8, 32, 32, 8), (4, 16, 32, 4),
            (16, 16, 16, 8), (8, 16, 8, 2), (16, 8, 32, 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="4096x32768,16384x8192,131072x1024,1024x131072")
    ap.add_argument("--missing", default="0,0.1")
    ap.add_argument("--launches", type=int, default=len(LAUNCHES), help="the first N of LAUNCHES")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds before the sweep stops")
    args = ap.parse_args()
    start = time.time()
    res = dict(commit=commit(), device=torch.cuda.get_device_name(), copy_GBps=copy_bandwidth(), rows=[])
    walks = dataclasses.replace(DEFAULT_CONFIG, chunks=False)
    for shape in args.shapes.split(","):
        C, T = (int(x) for x in shape.split("x"))
        for missing in (float(m) for m in args.missing.split(",")):
            views, init = problem(T, C, missing, "cuda")
            row = dict(C=C, T=T, missing=missing, launches=[])

            def pct(ms):
                return 100 * FWD_BYTES * T * C / ms / 1e6 / res["copy_GBps"]

            row["walks_ms"] = graph_ms(lambda: triton_backend.filter_forward(views, init, posterior=("mean", "var"),
                                                                            config=walks))
            row["walks_pct_copy"] = pct(row["walks_ms"])
            if missing == 0.0:
                scan = accelerated_scan(T, C)
                if scan is not None:
                    row["ascan_ms"], row["ascan_pct_copy"] = scan[0], pct(scan[0])
            for rows, steps, block, warps in LAUNCHES[:args.launches]:
                if time.time() - start > args.budget:
                    break
                cfg = dataclasses.replace(DEFAULT_CONFIG, chunks=True, chunk_rows=rows, chunk_steps=steps,
                                          chunk_block=block, chunk_warps=warps, chunk_min_programs=1)
                err = check(views, init, cfg)
                ms = graph_ms(lambda: triton_backend.filter_forward(views, init, posterior=("mean", "var"),
                                                                    config=cfg))
                row["launches"].append(dict(rows=rows, steps=steps, block=block, warps=warps, err=err, ms=ms,
                                            pct_copy=pct(ms)))
                print(json.dumps(dict(C=C, T=T, missing=missing, **row["launches"][-1])), flush=True)
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "launches"}), flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
