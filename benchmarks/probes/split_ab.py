"""The public ``ks.filter`` with one stretch against the rule's split, interleaved in one process.
A script, not a test.

    python -m benchmarks.probes.split_ab --out split.json           # on the GPU

At each shape ``(C, T)`` where ``plan`` walks one stretch because the rule
(``FilterConfig.target_lanes``) gave fewer than ``min_stretches``, the public call on a CUDA
float32 ``y`` (every field, and ``outputs=("mean", "var")``, checked as by default) and the same
call under gradients followed by a backward of the mean's sum are timed queued
(``triton.testing.do_bench`` medians) with ``min_stretches = 3`` (the default: one stretch) and
``min_stretches = 1`` (the rule's split), alternating for ``--rounds`` rounds. The switch sets the
field on the default configuration object itself, which every launch wrapper reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton.testing

import kalmanscan as ks
from benchmarks.common import commit
from kalmanscan.ops.filter.triton import backend as triton_backend
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG

SHAPES = [(131072, 1024), (131072, 2048), (196608, 1024)]


def calls(C, T):
    """The timed calls at ``(C, T)``: name -> function."""
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(T, C, device="cuda", generator=g)
    theta = torch.rand(C, device="cuda", generator=g) + 0.05
    kw = dict(theta=theta, sigma=0.5, obs_var=0.3)
    y_grad = y.clone().requires_grad_()

    def train():
        y_grad.grad = None
        ks.filter(y_grad, outputs=("mean", "var"), **kw).mean.sum().backward()

    return {"all": lambda: ks.filter(y, **kw), "mean_var": lambda: ks.filter(y, outputs=("mean", "var"), **kw),
            "fwd_bwd": train}


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.split_ab``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    res = dict(commit=commit(), device=torch.cuda.get_device_name(), rows=[])
    for C, T in SHAPES:
        fns = calls(C, T)
        times = {(name, ms): [] for name in fns for ms in (3, 1)}
        for _ in range(args.rounds):
            for ms in (3, 1):
                object.__setattr__(DEFAULT_CONFIG, "min_stretches", ms)
                for name, fn in fns.items():
                    times[name, ms].append(float(triton.testing.do_bench(fn, return_mode="median")))
        object.__setattr__(DEFAULT_CONFIG, "min_stretches", 3)
        rule = dataclasses.replace(DEFAULT_CONFIG, min_stretches=1)
        row = dict(C=C, T=T, split=triton_backend.plan(1, T, C, rule)[0],
                   **{f"{name}_one_stretch_ms": sorted(times[name, 3]) for name in fns},
                   **{f"{name}_split_ms": sorted(times[name, 1]) for name in fns})
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
