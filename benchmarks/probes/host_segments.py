"""Where the GPU default call is host-bound: the host's time between a call's last wait and the
next call's launches, beside the GPU time those launches must fit in. GPU only.

``ks.filter(y, theta=..., sigma=0.5, obs_var=0.3)`` reading ``mean, var, loglik`` at ``(T, C)``
float32, ``theta`` a CUDA tensor (``device``) or a NumPy array (``host``). A call queues its kernels
(aggregate pass, carry, forward walks), then waits for the values read back after the aggregate
pass (``y``'s check, and the parameters' verdicts for ``device``); the next call's host work runs
while the GPU walks. The GPU stays busy only if the host reaches the next forward launch before
this call's carry and forward walks, and the next aggregate pass, are done. For 100 calls, with
the GPU idle at each call's start (``idle``) and back to back (``steady``), medians in us:
``to_agg``, ``to_fwd``, ``to_wait`` (call start to the aggregate launch, the forward launch, the
first wait), ``tail`` (last wait's end to the call's end), ``crit`` and ``crit_fwd`` (a call's
last wait's end to the next call's aggregate / forward launch), ``per_call``. The kernels' GPU
times come from ``torch.profiler``; ``micro`` times pieces of a call's host work (us a call).

    python -m benchmarks.probes.host_segments [--shape 32768x4096] [--out host_segments.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import kalmanscan as ks
from benchmarks.probes.host_cost import per_call_us
from kalmanscan.ops.filter.triton import walks
from kalmanscan.problem import checks

EVENTS: list[tuple[str, float]] = []
"""``(what, perf_counter time)`` of the launches and waits the stand-ins note."""


class _Timed:
    """Stands for a Triton kernel of :mod:`~kalmanscan.ops.filter.triton.walks`: notes the time of
    each launch as ``name``, then launches it."""

    def __init__(self, kernel, name: str):
        self.kernel, self.name = kernel, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            EVENTS.append((self.name, time.perf_counter()))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _timed_read(read):
    def timed(self):
        EVENTS.append(("wait0", time.perf_counter()))
        values = read(self)
        EVENTS.append(("wait1", time.perf_counter()))
        return values
    return timed


def segments(call, idle: bool, n: int = 100) -> dict:
    """The medians of the module docstring over ``n`` calls of ``call``."""
    EVENTS.clear()
    for _ in range(n):
        if idle:
            torch.cuda.synchronize()
        EVENTS.append(("start", time.perf_counter()))
        call()
        EVENTS.append(("end", time.perf_counter()))
    torch.cuda.synchronize()
    calls = []
    for name, t in EVENTS:
        if name == "start":
            calls.append({})
        if name in ("wait0", "agg", "fwd"):
            calls[-1].setdefault(name, t)
        else:
            calls[-1][name] = t
    us = lambda v: round(1e6 * float(np.median(v)), 1)  # noqa: E731
    pairs = list(zip(calls, calls[1:]))
    return dict(to_agg=us([c["agg"] - c["start"] for c in calls]), to_fwd=us([c["fwd"] - c["start"] for c in calls]),
                to_wait=us([c["wait0"] - c["start"] for c in calls]), tail=us([c["end"] - c["wait1"] for c in calls]),
                crit=us([b["agg"] - a["wait1"] for a, b in pairs]),
                crit_fwd=us([b["fwd"] - a["wait1"] for a, b in pairs]),
                per_call=us([b["start"] - a["start"] for a, b in pairs]))


def kernel_us(call) -> dict:
    """``{kernel: (count, us each)}`` of 5 calls (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    return {e.key[:60]: (e.count, round(e.device_time_total / max(1, e.count), 1)) for e in prof.key_averages()
            if e.device_time_total > 0}


def micro_us(y: torch.Tensor) -> dict:
    """Host time of pieces of a call (us a call: :func:`~benchmarks.probes.host_cost.per_call_us`)."""
    flags = torch.zeros(14, dtype=torch.bool, device=y.device)
    rows = [torch.zeros(y.shape[-1], device=y.device) for _ in range(8)]
    pieces = {"Ahead(flags)": lambda: checks.Ahead(flags),
              "to_cpu_nonblocking": lambda: flags.to("cpu", non_blocking=True),
              "Event()+record()": lambda: torch.cuda.Event().record(),
              "current_stream(device)": lambda: torch.cuda.current_stream(y.device),
              "stack8": lambda: torch.stack(rows),
              "empty": lambda: torch.empty(5, y.shape[-1], device=y.device)}
    out = {name: round(per_call_us(fn, 200), 2) for name, fn in pieces.items()}
    torch.cuda.synchronize()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="32768x4096")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    T, C = (int(v) for v in args.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(T, C, device="cuda", generator=g)
    theta = torch.rand(C, device="cuda", generator=g) + 0.05
    kernels = (walks.filter_agg_kernel, walks.filter_fwd_kernel)
    read = checks.Ahead.read
    walks.filter_agg_kernel, walks.filter_fwd_kernel = _Timed(kernels[0], "agg"), _Timed(kernels[1], "fwd")
    checks.Ahead.read = _timed_read(read)
    out = dict(T=T, C=C, device=torch.cuda.get_device_name())
    try:
        for name, th in (("device", theta), ("host", theta.cpu().numpy())):
            def call(th=th):
                post = ks.filter(y, theta=th, sigma=0.5, obs_var=0.3)
                return post.mean, post.var, post.loglik
            for _ in range(10):
                call()
            for mode in ("idle", "steady"):
                out[f"{name}_{mode}"] = segments(call, mode == "idle")
                print(name, mode, out[f"{name}_{mode}"], flush=True)
    finally:
        walks.filter_agg_kernel, walks.filter_fwd_kernel = kernels
        checks.Ahead.read = read
    def device_call():
        post = ks.filter(y, theta=theta, sigma=0.5, obs_var=0.3)
        return post.mean, post.var, post.loglik
    out["kernels"] = kernel_us(device_call)
    out["micro"] = micro_us(y)
    print(json.dumps({k: out[k] for k in ("kernels", "micro")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
