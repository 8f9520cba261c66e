"""Speed benchmarks, run on a GPU (the paper-evidence harness is in ``evidence/``).

    benchmarks.bench_filter      the filter kernels: checks against float64 (benchmarks.filter_checks),
                                 times, launch-variant sweep, torch and JAX baselines
    benchmarks.bench_filter_api  the public ks.filter and ks.smooth calls end to end
    benchmarks.bench_kla         the KLA scan: GPU check, launch-shape sweep, times
    benchmarks/bench_distributed.py   sequence parallelism under torchrun
    benchmarks.profile_kernels   launches to read under Nsight Compute, and a summary of its CSV
    benchmarks.sass_stats        instruction counts of the kernels' loops, compiled without a GPU
"""
