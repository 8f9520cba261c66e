"""The walks' backward with the precision in closed form against the same backward reading ``lam``,
in one process (``FilterConfig.bwd_closed``, ``bwd_warps``). A script, not a test.

    python -m benchmarks.closed_bwd --out closed_bwd.json          # on the GPU
    python -m benchmarks.closed_bwd --out quick.json --quick       # CPU smoke test (interpreter)

For each shape and fraction of missing values (static parameters, as
:mod:`benchmarks.bench_recurrence` builds them): the backward alone given the saved forward (the
mean's and precision's cotangents) and the forward (four saved fields) plus backward, with the
closed-form precision and reading ``lam``, at each ``bwd_warps``; the differentiable call a fit
makes (``ks.filter`` with ``theta, sigma, obs_var`` requiring gradients, loss on the mean and the
log-likelihood, backward included) both ways; accelerated-scan's forward+backward at the same shape
and the copy bandwidth. CUDA-graph medians (the public call: ``do_bench`` medians, calls queued).
% of copy for the backward counts what it must move: 40 bytes an element reading ``lam`` (the
aggregate pass reads ``mu, lam`` and two cotangents, the walk the same and ``y``, and writes
``grad_y``), 32 with the closed form where every stretch but the first is complete. Before timing,
the two backwards' gradients are compared (worst error relative to each one's largest magnitude).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from benchmarks import bench_recurrence as rec
from benchmarks.bench_filter import copy_bandwidth, median_ms
from benchmarks.records import commit
from kalmanscan.ops.filter import triton as triton_backend
from kalmanscan.ops.filter.config import DEFAULT_CONFIG

SHAPES = [(4096, 32768), (64, 1 << 20), (16384, 8192)]
QUICK_SHAPES = [(8, 256)]
BYTES = {"read": 40, "closed": 32}


def backward_times(views, init, config):
    """``(bwd_ms, fwd_bwd_ms, grads)`` of the walks under ``config`` (cotangents of the mean and
    precision)."""
    T, C = views["y"].shape[1:]
    dev = views["y"].device
    g = torch.Generator(device=dev).manual_seed(1)
    cot = (torch.randn(1, T, C, device=dev, generator=g), torch.randn(1, T, C, device=dev, generator=g), None, None)
    out = triton_backend.filter_forward(views, init, config=config, closed_steps=True)

    def bwd():
        return triton_backend.filter_backward(views, init, out["mu"], out["lam"], cot, config, out["done"])

    def fwd_bwd():
        o = triton_backend.filter_forward(views, init, config=config, closed_steps=True)
        triton_backend.filter_backward(views, init, o["mu"], o["lam"], cot, config, o["done"])

    return rec.timer(bwd), rec.timer(fwd_bwd), bwd()


def public_fit_step(y, kw, config):
    """Milliseconds of the differentiable call a fit makes, forward and backward (queued)."""
    from kalmanscan.filtering import make_posterior
    from kalmanscan.inputs import prepare

    params = {k: v.clone().requires_grad_() for k, v in kw.items() if k in ("theta", "sigma", "obs_var")}
    rest = {k: v for k, v in kw.items() if k not in params}

    def step():
        p = prepare(y, **params, **rest, backend="triton")
        post = make_posterior(p, triton_backend.filter(p, config))
        loss = post.loglik.sum() + post.mean.square().mean()
        torch.autograd.grad(loss, list(params.values()))

    if rec.QUICK:
        return rec.timer(step)
    return median_ms(step)


def worst(a, b):
    return max(float((x - z).abs().max() / z.abs().max().clamp_min(1e-30)) for x, z in zip(a, b))


def row(T, C, missing, copy, warps):
    views, init, y, kw = rec.problem(T, C, missing, "cpu" if rec.QUICK else "cuda")
    n = T * C
    out = dict(C=C, T=T, missing=missing)
    grads = {}
    for closed in (True, False):
        for w in warps:
            name = f"{'closed' if closed else 'read'}_w{w}"
            cfg = dataclasses.replace(DEFAULT_CONFIG, bwd_closed=closed, bwd_warps=w)
            out[f"{name}_bwd_ms"], out[f"{name}_fwd_bwd_ms"], grads[name] = backward_times(views, init, cfg)
            moved = BYTES["closed" if closed else "read"] * n
            out[f"{name}_bwd_pct_copy"] = 100 * moved / out[f"{name}_bwd_ms"] / 1e6 / copy
        cfg = dataclasses.replace(DEFAULT_CONFIG, bwd_closed=closed)
        out[f"public_{'closed' if closed else 'read'}_ms"] = public_fit_step(y, kw, cfg)
    out["closed_vs_read_err"] = worst(grads[f"closed_w{warps[0]}"], grads[f"read_w{warps[0]}"])
    scan = rec.accelerated_scan(T, C) if missing == 0.0 else None
    if scan is not None:
        out["ascan_fwd_bwd_ms"] = scan[1]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test under TRITON_INTERPRET=1, tiny sizes")
    ap.add_argument("--warps", default="1,2", help="bwd_warps values, comma-separated")
    args = ap.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    copy = 1.0 if rec.QUICK else copy_bandwidth()
    res = dict(commit=commit(), device="cpu (interpreter)" if rec.QUICK else torch.cuda.get_device_name(),
               copy_GBps=copy, rows=[])
    for C, T in QUICK_SHAPES if rec.QUICK else SHAPES:
        for missing in rec.MISSING:
            res["rows"].append(row(T, C, missing, copy, warps))
            print(json.dumps(res["rows"][-1]), flush=True)
            rec.save(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
