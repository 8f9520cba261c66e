"""Kernel launches to read under Nsight Compute. A script, not a test.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        python -m benchmarks.probes.profile_kernels filter

Each workload runs twice untraced (compilation, autotuning), then once between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ``--profile-from-start off`` reports exactly the
kernels of one call. Workloads: ``filter`` (the fused forward writing mean and precision at
(C, T) = (4096, 32768) and (1, 2^22)), ``filter_bwd`` (the backward at (4096, 32768)), ``kla``
(``kla_scan`` forward and forward+backward at B=8, L=2048, M=1024, S=16), ``kla_layer`` (the
layer's scan at the model's T = 8192: B=2, split in time, no ``y_var``); the filter's launch
configuration is ``DEFAULT_CONFIG`` (:mod:`kalmanscan.ops.filter.triton.config`), or ``--filter-config
key=value ...`` fields changed from it; the scan's is its launch rule's, or with ``--kla-config
key=value,...`` fields changed from it.

With ``--page raw --csv > FILE`` added to the ``ncu`` line (and ``--section
MemoryWorkloadAnalysis --section SchedulerStats`` for the L2 hit rate and issue activity),
``python -m benchmarks.probes.profile_kernels --summary FILE`` prints one line per Triton kernel:
duration, DRAM throughput, SM throughput, issue activity, L2 hit rate, registers, active warps and
the four largest stall reasons (warps stalled per issued instruction).
"""

import argparse
import ast
import csv
import dataclasses

import torch

from benchmarks.bench_filter import static_problem
from benchmarks.common import launched_with, make_inputs, overrides
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG, FilterConfig


def _traced(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def filter_forward(config: FilterConfig = DEFAULT_CONFIG):
    from kalmanscan.ops.filter.triton import backend as triton_backend
    for C, T in ((4096, 32768), (1, 1 << 22)):
        views, init, _ = static_problem(T, C)
        _traced(lambda: triton_backend.filter_forward(views, init, outputs=("mu", "lam"), config=config))


def filter_backward(config: FilterConfig = DEFAULT_CONFIG):
    from kalmanscan.ops.filter.triton import backend as triton_backend
    views, init, _ = static_problem(32768, 4096)
    out = triton_backend.filter_forward(views, init, config=config)
    cot = torch.randn(4, 1, 32768, 4096, device="cuda")
    _traced(lambda: triton_backend.filter_backward(views, init, out["mu"], out["lam"], cot, config))


def kla():
    from kalmanscan.ops.kla import kla_scan
    xs = make_inputs(8, 2048, 1024, 16)
    with torch.no_grad():
        _traced(lambda: kla_scan(*xs, backend="triton"))
    xg = [x.clone().requires_grad_() for x in xs]
    gy = torch.randn(8, 2048, 1024, device="cuda")

    def fwd_bwd():
        y, y_var = kla_scan(*xg, backend="triton")
        torch.autograd.backward((y, y_var), (gy, gy))

    _traced(fwd_bwd)


def kla_layer():
    """What a layer of the model runs at T = 8192: the scan at B=2, L=8192, M=1024, S=16 without
    ``y_var``, forward and backward (the time split's map passes, the forward and the backward)."""
    from kalmanscan.ops.kla import kla_scan_unchecked
    xs = [x.clone().requires_grad_() for x in make_inputs(2, 8192, 1024, 16)]
    gy = torch.randn(2, 8192, 1024, device="cuda")

    def fwd_bwd():
        y, _ = kla_scan_unchecked(*xs, backend="triton", variance=False)
        torch.autograd.backward(y, gy)

    _traced(fwd_bwd)


WORKLOADS = dict(filter=filter_forward, filter_bwd=filter_backward, kla=lambda config: kla(),
                 kla_layer=lambda config: kla_layer())  # config: the filter's


STALL = "smsp__average_warps_issue_stalled_"
SUMMARY = (("us", "gpu__time_duration.sum", 1e-3),
           ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("DRAM TB/s", "dram__bytes.sum.per_second", 1e-12),
           ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
           ("L2 hit %", "lts__t_sector_hit_rate.pct", 1),
           ("regs", "launch__registers_per_thread", 1),
           ("warps active %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1))


def summary(path: str) -> str:
    """One line per profiled Triton kernel (names not starting ``at::``/``void``) of an
    ``ncu --page raw --csv`` file; durations in microseconds, DRAM bytes per second in TB/s."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    top = next(i for i, row in enumerate(rows) if row and row[0] == "ID")
    head = rows[top]
    lines = []
    for row in rows[top + 2:]:
        name = row[head.index("Kernel Name")]
        if name.startswith("void"):
            continue
        value = {h: v for h, v in zip(head, row)}
        number = lambda key: float(value[key].replace(",", ""))   # noqa: E731
        cells = [f"{label} {number(key) * scale:.3g}" for label, key, scale in SUMMARY]
        stalls = {h[len(STALL):].split("_per_issue")[0]: number(h) for h in head
                  if h.startswith(STALL) and h.endswith("per_issue_active.ratio")}
        worst = sorted(stalls.items(), key=lambda kv: -kv[1])[:4]
        cells.append("stalls " + ", ".join(f"{k} {v:.2f}" for k, v in worst)
                     + f" of {sum(stalls.values()):.2f}")
        lines.append(f"{name} {value['Grid Size']}x{value['Block Size']} | " + " | ".join(cells))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", help=f"any of {sorted(WORKLOADS)}")
    ap.add_argument("--summary", metavar="CSV", help="summarise an ncu raw CSV")
    ap.add_argument("--filter-config", nargs="*", default=[], metavar="KEY=VALUE",
                    help="FilterConfig fields changed from DEFAULT_CONFIG (values as Python literals)")
    ap.add_argument("--kla-config", default="-", metavar="KEY=VALUE,...",
                    help="KLAConfig fields changed in the scan's launch, e.g. l2_hints=true")
    a = ap.parse_args()
    unknown = sorted(set(a.workloads) - set(WORKLOADS))
    if unknown:
        ap.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    if a.summary:
        print(summary(a.summary))
    config = filter_config(a.filter_config)
    with launched_with(**overrides(a.kla_config)):
        for name in a.workloads:
            WORKLOADS[name](config)


def filter_config(options) -> FilterConfig:
    """``DEFAULT_CONFIG`` with the fields of ``options`` (``"key=value"`` strings) changed."""
    changes = {}
    for option in options:
        key, _, value = option.partition("=")
        changes[key] = ast.literal_eval(value)
    return dataclasses.replace(DEFAULT_CONFIG, **changes)


if __name__ == "__main__":
    main()
