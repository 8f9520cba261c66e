"""The benchmark suites: each one's module, what it measures, where it runs, and the commands of the
published tables it produces (``python -m benchmarks headline`` reruns them).

A suite's module has ``parser()`` (its command line, with an option naming the JSON file it writes:
``--out PATH`` unless :attr:`Suite.out` says otherwise) and ``main(argv)``; ``python -m benchmarks
run NAME ARGS...`` calls ``main(ARGS)``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shlex

__all__ = ["Run", "Suite", "SUITES", "available", "command"]


@dataclasses.dataclass(frozen=True)
class Run:
    """One published table: ``python -m benchmarks run SUITE *flags`` with the environment ``env``
    set; ``gpu`` when it needs CUDA. A table made by a probe of the suite's operation names its
    ``module`` (``python -m MODULE *flags``)."""

    flags: tuple[str, ...] = ()
    gpu: bool = True
    env: tuple[tuple[str, str], ...] = ()
    module: str | None = None


@dataclasses.dataclass(frozen=True)
class Suite:
    """A suite: its ``name`` on the command line, its ``module``, what it ``measures``, the
    ``device`` it runs on (``"GPU"``, ``"CPU"`` or ``"CPU, GPU"``), its ``headline`` runs and the
    option (``out``) that names the JSON file its module writes."""

    name: str
    module: str
    measures: str
    device: str
    headline: tuple[Run, ...] = ()
    out: str = "--out"


FLA_FIRST = (("KALMANSCAN_FLA_FIRST_CONFIG", "1"),)
GRAPH = ("--compile", "--cuda-graph", "--groups", "3", "--steps", "8")
QUEUED = ("--compile", "--groups", "3", "--steps", "8")

SUITES = {s.name: s for s in (
    Suite("filter", "benchmarks.bench_filter",
          "the filter's fused kernels against float64, then their times beside copy bandwidth, torch and JAX",
          "GPU", (Run(("--skip-checks",)),
                  Run(("--sweep-only", "--sweep-split", "--sweep-shapes", "4096x32768,64x1048576,16384x8192")))),
    Suite("api", "benchmarks.bench_api",
          "the public ks.filter, ks.smooth and kla_scan calls beside their kernels: queued, alone, fixed cost",
          "GPU", (Run(), Run(("--shapes", "5")))),
    Suite("filter_api", "benchmarks.bench_filter_api",
          "ks.filter and ks.smooth end to end against their kernels and the bytes they must move", "GPU", (Run(),)),
    Suite("cpu", "benchmarks.bench_cpu",
          "the compiled CPU loops against NumPy, statsmodels, simdkalman, filterpy, pykalman; a local level fit",
          "CPU", (Run(("--repeat", "3"), gpu=False),)),
    Suite("fit", "benchmarks.bench_fit",
          "ks.fit with standard errors on many series: wall time, iterations, synchronisations", "CPU, GPU",
          (Run(),)),
    Suite("stream", "benchmarks.bench_stream",
          "one step of 4096 sensors per call, the state carried: calls per second", "CPU, GPU",
          (Run(("--calls", "1000")), Run(("--device", "cpu", "--calls", "300", "--host-params"), gpu=False))),
    Suite("replay", "benchmarks.bench_replay",
          "small ks.filter calls replayed from CUDA graphs against the same calls launched eagerly", "GPU",
          (Run(("--rounds", "5", "--shapes", "4194304x1,1048576x1")),)),
    Suite("xr", "benchmarks.bench_xr",
          "the xarray accessor beside ks.filter and ks.smooth on the same NumPy data", "CPU", (Run(gpu=False),)),
    Suite("distributed", "benchmarks.bench_distributed",
          "sequence parallelism (ks.distributed), filter and KLA model, under torchrun", "CPU, GPU"),
    Suite("diffuse", "benchmarks.bench_diffuse",
          "the exact diffuse prior beside the same call with a finite prior", "CPU",
          (Run(("--repeat", "41"), gpu=False),)),
    Suite("kla", "benchmarks.bench_kla",
          "the KLA scan's kernels against float64, then their times beside the FP32 rate, torch and fla",
          "GPU", (Run(("--shapes", "2x8192,8x2048", "--repeat", "2", "--configs=-"),
                      module="benchmarks.probes.kla_pieces"),
                  Run(("--no-torch", "--shapes", "02")))),
    Suite("kla_cpu", "benchmarks.bench_kla_cpu",
          "the KLA scan and a KLA model on the CPU: compiled loops beside the torch backends", "CPU",
          (Run(gpu=False),)),
    Suite("model", "benchmarks.bench_model",
          "training throughput of one model with the KLA, fla GLA and attention mixers", "GPU",
          (Run((*GRAPH, "--mixers", "kla,attention,gla"), env=FLA_FIRST),
           Run((*QUEUED, "--mixers", "kla,attention,gla"), env=FLA_FIRST),
           Run((*GRAPH, "--shapes", "2x8192,1x16384,1x32768", "--mixers", "kla,attention"), env=FLA_FIRST))),
    Suite("gemms", "benchmarks.bench_gemms",
          "the matrix products of one model block alone, with their TFLOP/s and cuBLAS kernels", "GPU"),
    Suite("recurrence", "benchmarks.bench_recurrence",
          "the filter's forward beside a plain first-order linear recurrence (accelerated-scan)", "GPU",
          (Run(),)),
    Suite("decode", "benchmarks.bench_decode",
          "decoding one token a step (KLA, attention, GLA) from a CUDA graph, beside the bytes it must move",
          "GPU", (Run(),), out="--json"),
    Suite("lean", "benchmarks.bench_lean",
          "the default ks.filter (moments and log-likelihood written, the rest derived when read) against a "
          "NumPy loop, its peak memory; on the GPU against the mean-and-variance kernels", "CPU, GPU",
          (Run(gpu=False), Run(("--times", "--shapes", "10000x1000"), gpu=False), Run(("--device", "cuda")))),
    Suite("timechunks", "benchmarks.bench_timechunks",
          "a record larger than the workers' memory, chunked along time on a local dask cluster", "CPU",
          (Run(("--workers", "2", "--memory-limit", "2GiB", "--channels", "64", "--steps", "13000000",
                "--chunk-steps", "10000", "--ops", "filter"), gpu=False),
           Run(("--workers", "2", "--memory-limit", "2GiB", "--channels", "64", "--steps", "13000000",
                "--chunk-steps", "25000", "--ops", "smooth"), gpu=False))),
)}


def available(suite: Suite) -> bool:
    """Whether ``suite``'s module is in this checkout (found without importing it)."""
    return importlib.util.find_spec(suite.module) is not None


def command(suite: Suite, run: Run) -> str:
    """The shell command of ``run``: ``[ENV=VALUE ...] python -m benchmarks run NAME FLAGS...``
    (``python -m MODULE FLAGS...`` for a probe's)."""
    call = ["-m", run.module] if run.module else ["-m", "benchmarks", "run", suite.name]
    return shlex.join([f"{k}={v}" for k, v in run.env] + ["python", *call, *run.flags])
