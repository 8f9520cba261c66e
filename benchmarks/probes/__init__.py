"""Probes: profiler scripts (torch.profiler, Nsight Compute launches and their summaries, SASS
counts) and A/B scripts that set one launch setting or code path against another, each run as
``python -m benchmarks.probes.NAME``. One published table comes from a probe: the KLA scan's launch
table (``kla_pieces``), which ``python -m benchmarks headline`` reruns with the ``kla`` suite.
"""
