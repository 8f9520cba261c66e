"""End-to-end time of the public ``ks.filter`` call on the GPU (validation, kernels, derived fields).

The kernel benchmark (``bench_filter.py``) times the fused kernels alone; this script times what a
user pays for ``ks.filter(y, ...)`` returning the full :class:`~kalmanscan.Posterior` (filtered and
predicted moments, the predictive law of ``y`` and the log-likelihoods), and the fused kernels that
write it alone, against the copy bandwidth measured in the same run, and checks the triton result
against the float64 torch backend. It also times ``ks.smooth`` and its two smoothers alone on the
filter's output: the fused reverse walks (:func:`kalmanscan.ops.filter.triton.smooth`) and the
torch reverse scans (:func:`kalmanscan.ops.filter.torch.smooth`).

    python -m benchmarks run filter_api --out results.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import copy_bandwidth, every_field, initial_state, median_ms, save

import kalmanscan as ks
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter import run_backend
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter.triton import backend as triton_backend

SHAPES = [(4096, 32768), (64, 1 << 22)]
OUT_FIELDS = 10  # (..., T, C) arrays a Posterior holds: each written once, 4 bytes per element


def kernel_inputs(y, kw):
    """The fused forward's ``(B, T, C)`` views and initial state for ``ks.filter(y, **kw)``."""
    p = prepare(y, backend="triton", **kw)
    return triton_backend.kernel_views(p), initial_state(p)


def _max_rel_err(got, ref, fields):
    """Largest error of ``got`` against the float64 ``ref`` over ``fields``, relative to each field's max."""
    return max(float((getattr(got, k).double() - getattr(ref, k)).abs().max() / getattr(ref, k).abs().max())
               for k in fields)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run filter_api``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(3, 700, 5, device="cuda", dtype=torch.float64, generator=g)
    kw = dict(theta=torch.rand(5, device="cuda", dtype=torch.float64) + 0.1, sigma=0.7, obs_var=0.4)
    ref = ks.filter(y, backend="torch", **kw)
    got = ks.filter(y.float(), backend="triton", **kw)
    err = _max_rel_err(got, ref, ("mean", "var", "pred_mean", "pred_var", "logliks"))
    long_y = torch.randn(2, 200_003, 5, device="cuda", dtype=torch.float64, generator=g)  # many stretches
    smooth_err = max(_max_rel_err(ks.smooth(x.float(), backend="triton", **kw),
                                  ks.smooth(x, backend="torch", **kw), ("mean", "var")) for x in (y, long_y))
    bw = copy_bandwidth()
    rows = []
    for C, T in SHAPES:
        y = torch.randn(T, C, device="cuda", generator=g)
        theta = torch.rand(C, device="cuda", generator=g) + 0.05
        kw = dict(theta=theta, sigma=0.5, obs_var=0.3)
        ms = median_ms(every_field(lambda: ks.filter(y, backend="triton", **kw)))
        views, init = kernel_inputs(y, kw)
        kernel = median_ms(lambda: triton_backend.filter_forward(views, init, posterior=True))
        floor = (4 + 4 * OUT_FIELDS) * T * C / bw / 1e6
        p = prepare(y, backend="triton", **kw)
        out = run_backend(p, "triton")
        fields = {k: torch.broadcast_to(out[k], p.shape)
             for k in ("mean", "var", "pred_mean", "pred_var", "decay", "noise")}
        m = torch.broadcast_to(p.mean, p.shape)
        rts_fused = median_ms(lambda: triton_backend.smooth(fields, m))
        rts_scans = median_ms(lambda: torch_backend.smooth(fields, m))
        smooth_ms = median_ms(lambda: ks.smooth(y, backend="triton", **kw))
        rows.append(dict(C=C, T=T, ms=ms, kernel_ms=kernel, floor_ms=floor, fraction_of_copy=floor / ms,
                         kernel_fraction_of_copy=floor / kernel, smooth_ms=smooth_ms,
                         rts_fused_ms=rts_fused, rts_torch_ms=rts_scans,
                         rts_floor_ms=(4 * 4 + 3 * 4) * T * C / bw / 1e6))
        out = fields = None  # the next shape reuses the memory
    result = dict(device=torch.cuda.get_device_name(), copy_GBps=bw, max_rel_error_vs_float64=err,
                  smooth_max_rel_error_vs_float64=smooth_err, rows=rows)
    print(f"device {result['device']}, copy {bw:.0f} GB/s, triton vs float64 torch: filter {err:.1e}, "
          f"smoother {smooth_err:.1e}")
    print(f"{'C':>6} {'T':>9} {'ks.filter ms':>13} {'kernels ms':>11} {'floor ms':>9} {'% copy':>7}")
    for r in rows:
        print(f"{r['C']:>6} {r['T']:>9} {r['ms']:>13.2f} {r['kernel_ms']:>11.2f} {r['floor_ms']:>9.2f} "
              f"{100 * r['fraction_of_copy']:>6.1f}%")
    print("smoother: ks.smooth ms, fused RTS kernels ms, torch reverse scans ms, RTS floor ms "
          "(4 inputs and 3 outputs, 4 bytes each)")
    for r in rows:
        print(f"{r['C']:>6} {r['T']:>9} {r['smooth_ms']:>8.2f} {r['rts_fused_ms']:>8.2f} "
              f"{r['rts_torch_ms']:>8.2f} {r['rts_floor_ms']:>8.2f}")
    save(args.out, result)


if __name__ == "__main__":
    main()
