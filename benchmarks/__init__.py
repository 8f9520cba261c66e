"""Speed benchmarks: each timing beside the hardware limit and the peers, in one process.

    python -m benchmarks                             # the suites (benchmarks/suites.py), one line each
    python -m benchmarks run SUITE [ARGS...]         # one suite; ARGS --help for its options
    python -m benchmarks headline --out DIR          # rerun every published table, JSON and markdown

``bench_*.py`` are the suites; ``common.py`` what they share (the commit, timers, inputs);
``probes/`` the profiler scripts and A/B probes behind the design decisions; ``results/`` the raw
results the docs cite. The paper-evidence harness is ``evidence/``.
"""
