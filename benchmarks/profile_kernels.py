"""Kernel launches to read under Nsight Compute. A script, not a test.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        python -m benchmarks.profile_kernels filter

Each workload runs twice untraced (compilation, autotuning), then once between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ``--profile-from-start off`` reports exactly the
kernels of one call. Workloads: ``filter`` (the fused forward writing mean and precision at
(C, T) = (4096, 32768) and (1, 2^22)), ``filter_chain`` (the opt-in single-pass chained forward,
``fused.CHAIN``, at (4096, 32768)), ``filter_bwd`` (the backward at (4096, 32768)), ``kla``
(``kla_scan`` forward and forward+backward at B=8, L=2048, M=1024, S=16).
"""

import argparse

import torch

from benchmarks.bench_filter import static_problem
from benchmarks.bench_kla import make_inputs


def _traced(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def filter_forward():
    from kalmanscan import fused
    for C, T in ((4096, 32768), (1, 1 << 22)):
        views, init, _ = static_problem(T, C)
        _traced(lambda: fused.filter_forward(views, init, outputs=("mu", "lam")))


def filter_chain():
    from kalmanscan import fused
    views, init, _ = static_problem(32768, 4096)
    saved = fused.CHAIN
    fused.CHAIN = True
    try:
        _traced(lambda: fused.filter_forward(views, init, outputs=("mu", "lam")))
    finally:
        fused.CHAIN = saved


def filter_backward():
    from kalmanscan import fused
    views, init, _ = static_problem(32768, 4096)
    out = fused.filter_forward(views, init)
    cot = torch.randn(4, 1, 32768, 4096, device="cuda")
    _traced(lambda: fused.filter_backward(views, init, out["mu"], out["lam"], cot))


def kla():
    from kalmanscan.nn.scan import kla_scan
    xs = make_inputs(8, 2048, 1024, 16)
    with torch.no_grad():
        _traced(lambda: kla_scan(*xs, backend="triton"))
    xg = [x.clone().requires_grad_() for x in xs]
    gy = torch.randn(8, 2048, 1024, device="cuda")

    def fwd_bwd():
        y, y_var = kla_scan(*xg, backend="triton")
        torch.autograd.backward((y, y_var), (gy, gy))

    _traced(fwd_bwd)


WORKLOADS = dict(filter=filter_forward, filter_chain=filter_chain, filter_bwd=filter_backward,
                 kla=kla)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", choices=sorted(WORKLOADS))
    for name in ap.parse_args().workloads:
        WORKLOADS[name]()


if __name__ == "__main__":
    main()
