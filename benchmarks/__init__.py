"""Benchmarks: GPU timings (``bench_*.py``) and task evaluations of the KLA layer against
baseline mixers, all trained by one harness.

    benchmarks.tasks      seeded generators (group word problems, MQAR, the MAD suite)
    benchmarks.train      the single training entry point (``python -m benchmarks.train``)
    benchmarks.protocols  the reduced protocols: several runs in parallel processes, JSON out
    benchmarks.plots      figures and tables from the JSON results
"""
