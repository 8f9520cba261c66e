"""What the benchmark suites share: the commit a result records, shape lists, timers (host wall time
on any machine; queued, alone and CUDA-graph times on a GPU), the filter's and the KLA scan's
inputs, the filter's call with every field read, and the KLA scan's launch overrides.

GPU timers synchronise with the device; every one returns milliseconds unless its name says
otherwise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kalmanscan.inference.derived import DERIVED

__all__ = ["commit", "save", "shape_list", "wall_times", "shapes_parser", "write_shape_rows", "median_ms", "graph_ms",
           "timed", "alone_ms", "copy_bandwidth", "call_counts", "initial_state", "make_inputs", "every_field",
           "launched_with", "overrides"]


def commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout, with ``+dirty`` when it has local changes;
    the environment variable ``BENCHMARKS_COMMIT`` overrides it (for copies without git data)."""
    if os.environ.get("BENCHMARKS_COMMIT"):
        return os.environ["BENCHMARKS_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def save(path: str | None, result) -> None:
    """Write ``result`` as JSON to ``path``; nothing without one. Suites call it as rows arrive too,
    so that a run stopped by a time limit keeps the rows it finished."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def shape_list(text: str) -> list[tuple[int, ...]]:
    """``"2x8192,8x2048"`` -> ``[(2, 8192), (8, 2048)]``: a command line's list of shapes."""
    return [tuple(int(x) for x in shape.split("x")) for shape in text.split(",")]


# --- host wall time (any machine) -------------------------------------------------------------------


def wall_times(fn: Callable[[], object], repeat: int, warmup: bool = True) -> list[float]:
    """``repeat`` wall times of ``fn()`` in seconds, after one untimed call when ``warmup``."""
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def shapes_parser(description: str, repeat: int = 7) -> argparse.ArgumentParser:
    """The command line of a CPU benchmark over shapes: ``--out`` (JSON file) and ``--repeat``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--repeat", type=int, default=repeat)
    return ap


def write_shape_rows(args: argparse.Namespace, shapes: Sequence[tuple[int, int]],
                     row: Callable[[int, int, int], dict]) -> dict:
    """Run ``row(T, C, args.repeat)`` for each shape, print each row as JSON, write
    ``{"commit", "rows"}`` to ``args.out`` (when given) and return it."""
    res = dict(commit=commit(), rows=[])
    for T, C in shapes:
        res["rows"].append(row(T, C, args.repeat))
        print(json.dumps(res["rows"][-1]), flush=True)
    save(args.out, res)
    return res


# --- GPU timers ------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object]) -> float:
    """Median of ``triton.testing.do_bench``: calls back to back, the GPU's time per call."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: the GPU's time without the host's
    launch overhead (which dominates the few-series shapes, whose kernels take tens of microseconds)."""
    import triton.testing
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def timed(fn: Callable[[], object], reps: int = 20, warmup: int = 3, groups: int = 5) -> float:
    """Milliseconds per call of ``fn()`` with launches queued ahead, as in a training loop: the
    median over ``groups`` of ``reps`` calls back to back between two CUDA events (the GPU's time
    whenever the host launches faster than the GPU runs; the host's latency enters once per group)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(groups):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def alone_ms(fn: Callable[[], object], reps: int = 30) -> float:
    """Median host wall time of one call followed by a device synchronisation."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: bytes read plus written over the median time (GB/s)."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


class Dispatched(TorchDispatchMode):
    """Counts the torch operations a call dispatches, its scalar reads back to the host (one
    synchronisation each) and its copies from the host to the device."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.to_device = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func)] += 1
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        if isinstance(out, torch.Tensor) and out.device.type == "cuda" and any(a.device.type == "cpu" for a in ins):
            self.to_device += 1
        return out


def call_counts(fn: Callable[[], object]) -> dict:
    """Operations, synchronisations and host-to-device copies of one call of ``fn``."""
    fn()
    with Dispatched() as d:
        fn()
    return dict(ops=sum(d.ops.values()), syncs=d.ops["aten._local_scalar_dense.default"], h2d=d.to_device)


SYNC_WARNING = "called a synchronizing CUDA operation"
"""The text of torch's sync debug mode warning at each synchronisation (its other warning, that
the mode is a prototype, is not one)."""


def synchronisations(fn: Callable[[], object]) -> tuple[object, int]:
    """``(fn(), n)``: the device synchronisations ``fn()`` made on CUDA, as torch's sync debug mode
    reports them (blocking copies included) plus the waits on CUDA events (the reads of values
    queued ahead of a call's kernels, ``kalmanscan.problem.checks.Ahead``)."""
    waits = []
    wait = torch.cuda.Event.synchronize

    def counted(event):
        waits.append(event)
        return wait(event)

    with warnings.catch_warnings(record=True) as caught, mock.patch.object(torch.cuda.Event, "synchronize", counted):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, len(waits) + sum(SYNC_WARNING in str(w.message) for w in caught)


# --- inputs ----------------------------------------------------------------------------------------


def initial_state(p) -> torch.Tensor:
    """The filter kernels' initial state ``(B, 2, C)`` of a prepared problem ``p``: ``lam0`` and
    ``lam0 (init_mean - mean_0)`` (as :func:`kalmanscan.ops.filter.triton.filter` builds it)."""
    C = p.shape[-1]
    lam0 = (1.0 / p.init_var).expand(p.shape[:-2] + (1, C)).reshape(-1, C)
    mu0 = (p.init_mean - p.mean[..., :1, :]).expand(p.shape[:-2] + (1, C)).reshape(-1, C)
    return torch.stack([lam0, lam0 * mu0], 1).contiguous()


def every_field(filter_call: Callable[[], object]) -> Callable[[], object]:
    """``filter_call`` (returning a Posterior) followed by a read of every derived field (each made
    on first read, :mod:`kalmanscan.inference.derived`): the call as a caller of every field, or a
    peer that computes them all, pays for it. Returns the Posterior."""
    def call():
        post = filter_call()
        for name in DERIVED:
            getattr(post, name)
        return post

    return call


def make_inputs(B, L, M, S, seed=0, dtype=torch.float32, state=False, device="cuda") -> list[torch.Tensor]:
    """Random ``kla_scan`` inputs ``(v, lam_v, k, q, decay, noise)``: v, lam_v ``(B, L, M)`` in
    ``dtype``, k, q ``(B, L, S)`` unit vectors in ``dtype``, decay, noise ``(M, S)`` float32; with
    ``state``, an initial ``(lam, eta)`` ``(B, M, S)`` as well."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=g)
    xs = [
        torch.randn(B, L, M, **kw),
        0.1 + 2.0 * torch.rand(B, L, M, **kw),
        torch.nn.functional.normalize(torch.randn(B, L, S, **kw), dim=-1),
        torch.nn.functional.normalize(torch.randn(B, L, S, **kw), dim=-1),
        0.6 + 0.4 * torch.rand(M, S, **kw),
        0.05 + 0.95 * torch.rand(M, S, **kw),
    ]
    xs = [x.to(dtype) for x in xs[:4]] + xs[4:]
    if state:
        xs += [0.5 + torch.rand(B, M, S, **kw), torch.randn(B, M, S, **kw)]
    return xs


# --- the KLA scan's launch ---------------------------------------------------------------------------


@contextlib.contextmanager
def launched_with(**changes):
    """Inside, the scan's launch configurations (``launch_config``, which the layer and the public
    call use) have ``changes`` applied, e.g. ``even=True`` (drop the kernels' bounds masks where the
    blocks are full) or ``bwd_per_sm=16``."""
    from kalmanscan.ops.kla.triton import backend as kla_triton

    original = kla_triton.launch_config
    kla_triton.launch_config = lambda *args, **kwargs: dataclasses.replace(original(*args, **kwargs), **changes)
    try:
        yield
    finally:
        kla_triton.launch_config = original


def overrides(text: str) -> dict:
    """``"stages=1,bwd_pieces=12,even=true"`` -> ``{"stages": 1, "bwd_pieces": 12, "even": True}``
    (``"-"``: none; ``none``, ``true`` and ``false`` are Python's, other values integers)."""
    words = {"none": None, "true": True, "false": False}
    out = {}
    for item in ([] if text.strip() == "-" else text.split(",")):
        name, value = (x.strip() for x in item.split("="))
        out[name] = words[value.lower()] if value.lower() in words else int(value)
    return out
