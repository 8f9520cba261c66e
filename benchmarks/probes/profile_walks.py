"""The walks' forward kernels, closed and composed aggregate, under Nsight Compute. A script, not a test.

    ncu --profile-from-start off --clock-control none -k regex:filter_ --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats \\
        python -m benchmarks.probes.profile_walks

At (C, T) = (4096, 32768), the static problem of :mod:`benchmarks.bench_recurrence`, the mean and
variance: after two warm-up calls of each, one forward with the default configuration (the closed
aggregate, ``agg_warps`` warps) and one with ``walk_closed=False, agg_warps=1`` (the composed
aggregate as it was launched before), between ``cudaProfilerStart`` and ``cudaProfilerStop``.
"""

import dataclasses

import torch

from benchmarks.bench_recurrence import problem
from kalmanscan.ops.filter.triton import backend as triton_backend
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG


def main():
    views, init, _, _ = problem(32768, 4096, 0.0, "cuda")
    composed = dataclasses.replace(DEFAULT_CONFIG, walk_closed=False, agg_warps=1)
    for config in (DEFAULT_CONFIG, composed) * 2:
        triton_backend.filter_forward(views, init, posterior=("mean", "var"), config=config)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for config in (DEFAULT_CONFIG, composed):
        triton_backend.filter_forward(views, init, posterior=("mean", "var"), config=config)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
