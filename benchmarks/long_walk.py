"""One walk over all of time per channel, with steady steps once the precision is at its fixed point:
a forward measured for issue 25 (mean and variance out, static parameters). A script, not a test.

    python -m benchmarks.long_walk --out long_walk.json          # on the GPU
    python -m benchmarks.long_walk --out quick.json --quick      # CPU check under the interpreter

A program owns ``BLOCK`` channels of one batch row and walks ``t = 0 .. T-1`` in chunks of ``U``
steps, reading ``y`` once (12 bytes per element moved, no aggregate pass). A chunk with no missing
value, entered at the precision's fixed point, takes *steady* steps: the gate ``f*``, the variance
``var*`` are per-channel constants, and a step is ``eta <- f* eta + hr (y - h mean)`` (one
dependent multiply-add). Every other chunk takes the general step of the walks; after it the
program turns steady when, in every lane, the last step moved ``lam`` by at most
``TOL (1 - f^2) lam`` (``f^2`` is the map's derivative at the fixed point, so the distance left is
at most ``TOL lam``). Entered at an exact float fixed point the steady steps give the walks' bits.

``ROWS`` loads a chunk as ``U`` row vectors (Triton's pipeliner copies each ahead into shared
memory); otherwise as one ``[U, BLOCK]`` tile with the channel stride unspecialised, so each
thread holds its channel's ``U`` steps and a row is picked in registers. ``PURE`` times the steady
step alone from ``t = 0`` (wrong numbers: the bound of the loop, not a filter).

Each variant is checked against the float64 walks (max relative error of mean and variance) and
timed (CUDA-graph median) beside the walks' forward and accelerated-scan's recurrence (when
installed) in the same process, with the device's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.bench_recurrence import accelerated_scan, problem  # noqa: E402
from benchmarks.records import commit  # noqa: E402
from kalmanscan import ou  # noqa: E402
from kalmanscan.kernels.fast_math import rcp  # noqa: E402
from kalmanscan.ops.filter import triton as triton_backend  # noqa: E402


@triton.jit
def pick_row(data, rows, i: tl.constexpr, ROWS: tl.constexpr):
    """Step ``i`` of a chunk: ``data[i]`` of a tuple of rows, or row ``i`` of a tile (in registers)."""
    if ROWS:
        y = data[i]
    else:
        y = tl.sum(tl.where(rows == i, data, 0.0), axis=0)
    return y


@triton.jit
def general_steps(data, rows, lam, eta, t0, zc, ok, T, decay, noise, hr, phi_obs, hmean, mean, base, C,
                  mu_ptr, var_ptr, U: tl.constexpr, ROWS: tl.constexpr):
    """``U`` steps of the walks' information filter; returns the state, the last step's ``lam``
    before it and its gate ``f``."""
    lam_prev = lam
    f = decay
    for i in tl.static_range(U):
        t = zc + t0 + i
        valid = ok & (t < T)
        first = t == 0
        a = tl.where(first, 1.0, decay)
        q = tl.where(first, 0.0, noise)
        y = pick_row(data, rows, i, ROWS)
        observed = (y == y) & valid
        info = tl.where(observed, hr * (y - hmean), 0.0)
        rho = rcp(a * a + q * lam)
        f = a * rho
        lam_prev = lam
        lam = tl.where(valid, rho * lam + tl.where(observed, phi_obs, 0.0), lam)
        eta = tl.where(valid, f * eta + info, eta)
        var = rcp(lam)
        o = base + t * C
        tl.store(mu_ptr + o, eta * var + mean, mask=valid)
        tl.store(var_ptr + o, var, mask=valid)
    return lam, eta, lam_prev, f


@triton.jit(do_not_specialize=["sc"])
def long_walk_kernel(y_ptr, decay_ptr, noise_ptr, obs_var_ptr, mean_ptr, h_ptr, init_ptr, mu_ptr, var_ptr,
                     count_ptr, T, C, sc, TOL, BLOCK: tl.constexpr, U: tl.constexpr, STAGES: tl.constexpr,
                     ROWS: tl.constexpr, PURE: tl.constexpr):
    """The walk of module docstring; ``count[b, program]``: chunks taken steady."""
    b = tl.program_id(1)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = c < C
    decay = tl.load(decay_ptr + b * C + c, mask=ok, other=1.0)
    noise = tl.load(noise_ptr + b * C + c, mask=ok, other=0.0)
    obs_var = tl.load(obs_var_ptr + b * C + c, mask=ok, other=1.0)
    mean = tl.load(mean_ptr + b * C + c, mask=ok, other=0.0)
    h = tl.load(h_ptr + b * C + c, mask=ok, other=0.0)
    hr = h / obs_var
    phi_obs = hr * h
    hmean = h * mean
    lam = tl.load(init_ptr + b * 2 * C + c, mask=ok, other=1.0)
    eta = tl.load(init_ptr + b * 2 * C + C + c, mask=ok, other=0.0)
    rho_s = rcp(decay * decay + noise * lam)
    f_s = decay * rho_s
    var_s = rcp(lam)
    steady = (tl.program_id(0) * 0 + PURE) != 0
    n_steady = tl.program_id(0) * 0
    base = b * T * C + c * sc
    rows = tl.arange(0, U)[:, None]
    zc = c * 0
    for t0 in tl.range(0, T, U, num_stages=STAGES):
        if ROWS:
            data = ()
            gap = c < 0
            for i in tl.static_range(U):
                yi = tl.load(y_ptr + base + (t0 + i) * C, mask=ok & (zc + t0 + i < T), other=0.0)
                gap = gap | (yi != yi)
                data = data + (yi,)
            has_gap = tl.max(gap.to(tl.int32), axis=0) > 0
        else:
            data = tl.load(y_ptr + base[None, :] + (t0 + rows) * C, mask=ok[None, :] & (t0 + rows < T), other=0.0)
            has_gap = tl.max(tl.max((data != data).to(tl.int32), axis=0), axis=0) > 0
        if steady & ((not has_gap) | (PURE != 0)):
            n_steady += 1
            for i in tl.static_range(U):
                valid = ok & (zc + t0 + i < T)
                eta = f_s * eta + hr * (pick_row(data, rows, i, ROWS) - hmean)
                o = base + (t0 + i) * C
                tl.store(mu_ptr + o, eta * var_s + mean, mask=valid)
                tl.store(var_ptr + o, var_s, mask=valid)
        else:
            lam, eta, lam_prev, f = general_steps(data, rows, lam, eta, t0, zc, ok, T, decay, noise, hr, phi_obs,
                                                  hmean, mean, base, C, mu_ptr, var_ptr, U, ROWS)
            near = tl.abs(lam - lam_prev) <= TOL * (1.0 - f * f) * lam
            steady = tl.min(((near & (zc + t0 > 0) & (not has_gap)) | (c >= C)).to(tl.int32), axis=0) > 0
            rho_s = rcp(decay * decay + noise * lam)
            f_s = decay * rho_s
            var_s = rcp(lam)
    tl.store(count_ptr + b * tl.num_programs(0) + tl.program_id(0), n_steady)


def long_walk(views, init, BLOCK=32, U=16, STAGES=3, ROWS=True, PURE=False, counts=None):
    """``(mean, var)`` of the ``(B, T, C)`` problem ``views`` (static parameters) from the initial
    state ``init`` ``(B, 2, C)``; ``counts`` (int32, one per program) receives the steady chunks."""
    y = views["y"]
    B, T, C = y.shape
    decay, noise = ou.discretize(*(views[k][:, 0, :].double() for k in ("theta", "sigma", "dt")))
    obs_var, mean, h = (views[k][:, 0, :] for k in ("obs_var", "mean", "h"))
    statics = [x.to(y.dtype).contiguous() for x in (decay, noise, obs_var, mean, h)]
    mu, var = torch.empty_like(y), torch.empty_like(y)
    grid = (triton.cdiv(C, BLOCK), B)
    if counts is None:
        counts = torch.empty(grid[0] * B, dtype=torch.int32, device=y.device)
    long_walk_kernel[grid](y, *statics, init, mu, var, counts, T, C, y.stride(2), 4 * torch.finfo(y.dtype).eps,
                           BLOCK=BLOCK, U=U, STAGES=STAGES, ROWS=ROWS, PURE=PURE, num_warps=1)
    return mu, var


def error(views, init, **variant):
    """Worst relative error of the mean and variance against the float64 walks."""
    want = triton_backend.filter_forward({k: v.double() for k, v in views.items()}, init.double(),
                                         posterior=("mean", "var"))
    mu, var = long_walk(views, init, **variant)
    return max(float((mu.double() - want["mean"]).abs().max() / want["mean"].abs().max()),
               float(((var.double() - want["var"]).abs() / want["var"]).max()))


def timer(fn):
    if QUICK:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


VARIANTS = [dict(ROWS=True, U=16, STAGES=3), dict(ROWS=True, U=32, STAGES=3),
            dict(ROWS=True, U=16, STAGES=3, PURE=True), dict(ROWS=False, U=16, STAGES=4),
            dict(ROWS=False, U=16, STAGES=4, PURE=True)]
SHAPES = [(4096, 32768, 0.0), (4096, 32768, 0.1), (16384, 8192, 0.0)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="CPU check under TRITON_INTERPRET=1, tiny sizes")
    args = ap.parse_args()
    from benchmarks.bench_filter import copy_bandwidth
    res = dict(commit=commit(), device="cpu (interpreter)" if QUICK else torch.cuda.get_device_name(),
               copy_GBps=None if QUICK else copy_bandwidth(), rows=[])
    shapes = [(8, 100, 0.0), (8, 100, 0.1), (3, 1, 0.0)] if QUICK else SHAPES
    variants = [dict(v, BLOCK=8, U=4, STAGES=1) for v in VARIANTS[::3]] if QUICK else VARIANTS
    for C, T, missing in shapes:
        dtype = torch.float64 if QUICK else torch.float32
        views, init = problem(T, C, missing, "cpu" if QUICK else "cuda", dtype=dtype)
        row = dict(C=C, T=T, missing=missing, variants=[])
        row["walks_fwd_ms"] = timer(lambda: triton_backend.filter_forward(views, init, posterior=("mean", "var")))
        scan_ms = accelerated_scan(T, C) if missing == 0.0 else None
        if scan_ms is not None:
            row["ascan_fwd_ms"] = scan_ms[0]
        res["rows"].append(row)
        for v in variants:
            entry = dict(v)
            try:
                counts = torch.zeros(triton.cdiv(C, v.get("BLOCK", 32)), dtype=torch.int32, device=views["y"].device)
                entry["err"] = None if v.get("PURE") else error(views, init, **v)
                long_walk(views, init, counts=counts, **v)
                entry["steady_chunks"] = float(counts.float().mean()) / triton.cdiv(T, v["U"])
                entry["ms"] = timer(lambda: long_walk(views, init, **v))
                if res["copy_GBps"]:
                    entry["pct_copy"] = 100 * 12 * T * C / entry["ms"] / 1e6 / res["copy_GBps"]
            except Exception as exc:  # a variant Triton fails to compile is recorded, the rest still run
                entry["failed"] = repr(exc)[-300:]
            row["variants"].append(entry)
            print(C, T, missing, entry, flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
            if missing > 0:
                break
        print(json.dumps({k: x for k, x in row.items() if k != "variants"}), flush=True)


if __name__ == "__main__":
    main()
