"""The public GPU calls beside their kernels, in one process: ``ks.filter``, ``ks.smooth``,
``ks.nn.kla_scan``.

For each shape ``(C, T)``: the public ``ks.filter(y, ...)`` on a CUDA float32 ``y`` with every
field read (the derived ones are computed on first read) and with ``outputs=("mean", "var")``,
the fused kernels that write the same fields alone (:func:`kalmanscan.ops.filter.triton.filter_forward`),
``ks.smooth`` and its kernels, each as
*queued* (calls back to back, the GPU's time per call: ``triton.testing.do_bench``) and *alone*
(host wall time of one synchronised call, median). The floors are the bytes each call must move
(4 bytes per element read of ``y``, 4 per element written per field) over the copy bandwidth
measured in the same run. The public call is timed with ``check_finite=False`` as well (no
synchronisation: calls queue behind each other), and with ``theta`` given as a device tensor (its
checks read on the device, once the kernels are queued). Per shape it also prints the fixed cost of a
call (the public call alone minus its kernels alone), the time of the log-likelihood's sum over
time (a pass over the per-step values after the kernels), and what one ``ks.filter`` / ``ks.smooth``
call dispatches: torch operations, synchronisations (scalar reads) and host-to-device copies. The KLA scan's public call
is timed against its kernels the same way. Results are checked against the float64 torch backend
first.

    python -m benchmarks run api --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kalmanscan as ks
from benchmarks.common import alone_ms, call_counts, commit, copy_bandwidth, every_field, initial_state, median_ms, save
from kalmanscan.inference.filtering import sum_time
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton import backend as triton_backend
from kalmanscan.ops.kla.triton.backend import kla_scan_triton

SHAPES = [(4096, 32768), (64, 1 << 22), (4096, 2048), (1, 1 << 22), (64, 1 << 20), (64, 2048), (131072, 1024),
          (1, 1 << 24)]
ALL_FIELDS = 10            # (..., T, C) arrays of a Posterior, 4 bytes each
KLA_SHAPE = (8, 2048, 1024, 16)


def both(fn) -> dict:
    return dict(queued=median_ms(fn), alone=alone_ms(fn))


def check(g) -> float:
    y = torch.randn(3, 700, 5, device="cuda", dtype=torch.float64, generator=g)
    kw = dict(theta=0.3, sigma=0.7, obs_var=0.4)
    ref = ks.filter(y, backend="torch", **kw)
    got = ks.filter(y.float(), backend="triton", **kw)
    sel = ks.filter(y.float(), backend="triton", outputs=("mean", "var"), **kw)
    errs = [float((getattr(p, k).double() - getattr(ref, k)).abs().max() / getattr(ref, k).abs().max())
            for p in (got, sel) for k in ("mean", "var")]
    errs.append(float((got.loglik.double() - ref.loglik).abs().max() / ref.loglik.abs().max()))
    return max(errs)


def filter_rows(g, bw, shapes=SHAPES) -> list[dict]:
    rows = []
    for C, T in shapes:
        y = torch.randn(T, C, device="cuda", generator=g)
        kw = dict(theta=0.2, sigma=0.5, obs_var=0.3)
        theta_dev = torch.full((C,), 0.2, device="cuda")  # a parameter on the device: its checks read there
        p = prepare(y, backend="triton", **kw)
        views, init = triton_backend.kernel_views(p), initial_state(p)
        n = T * C
        row = dict(C=C, T=T,
                   public_all=both(every_field(lambda: ks.filter(y, backend="triton", **kw))),
                   kernel_all=both(lambda: triton_backend.filter_forward(views, init, posterior=True)),
                   public_mean_var=both(lambda: ks.filter(y, backend="triton", outputs=("mean", "var"), **kw)),
                   kernel_mean_var=both(lambda: triton_backend.filter_forward(views, init,
                                                                              posterior=("mean", "var"))),
                   public_all_unchecked=both(every_field(lambda: ks.filter(y, backend="triton", check_finite=False,
                                                                           **kw))),
                   public_mean_var_unchecked=both(lambda: ks.filter(y, backend="triton", outputs=("mean", "var"),
                                                                    check_finite=False, **kw)),
                   public_all_device_params=both(every_field(
                       lambda: ks.filter(y, backend="triton", **dict(kw, theta=theta_dev)))),
                   floor_all_ms=(4 + 4 * ALL_FIELDS) * n / bw / 1e6, floor_mean_var_ms=12 * n / bw / 1e6)
        logliks = ks.filter(y, backend="triton", outputs=("loglik",), **kw).logliks
        row["loglik_sum"] = both(lambda: sum_time(logliks))  # the public call's pass after its kernels
        if n <= (1 << 27):
            row["public_smooth"] = both(lambda: ks.smooth(y, backend="triton", **kw))
        row["fixed_all_ms"] = row["public_all"]["alone"] - row["kernel_all"]["alone"]
        row["counts_all"] = call_counts(lambda: ks.filter(y, backend="triton", **kw))
        row["counts_smooth"] = call_counts(lambda: ks.smooth(y, backend="triton", **kw))
        rows.append(row)
        print(json.dumps(row), flush=True)     # as it goes: a capped run keeps the rows it finished
    return rows


def kla_row(g) -> dict:
    B, L, M, S = KLA_SHAPE
    v = torch.randn(B, L, M, device="cuda", generator=g)
    lam_v = torch.rand(B, L, M, device="cuda", generator=g) + 0.5
    k = torch.nn.functional.normalize(torch.randn(B, L, S, device="cuda", generator=g), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(B, L, S, device="cuda", generator=g), dim=-1)
    decay = torch.rand(M, S, device="cuda", generator=g) * 0.5 + 0.45
    noise = torch.rand(M, S, device="cuda", generator=g) * 0.1 + 0.01
    xs = [x.requires_grad_() for x in (v, lam_v, k, q, decay, noise)]

    def fwd_bwd(fn):
        def run():
            y, y_var = fn()[:2]
            torch.autograd.backward((y, y_var), (torch.ones_like(y), torch.ones_like(y_var)))
        return run

    public = lambda: ks.nn.kla_scan(*xs, backend="triton")  # noqa: E731
    kernels = lambda: kla_scan_triton(*xs)  # noqa: E731
    with torch.no_grad():
        fwd = dict(public=both(public), kernels=both(kernels))
    return dict(B=B, L=L, M=M, S=S, fwd=fwd,
                fwd_bwd=dict(public=both(fwd_bwd(public)), kernels=both(fwd_bwd(kernels))))


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run api``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--shapes", default=None, help="indices into SHAPES, e.g. 0,5 (default: all)")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    err = check(g)
    bw = copy_bandwidth()
    rows = filter_rows(g, bw, shapes)
    kla = kla_row(g)
    result = dict(commit=commit(), date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, copy_GBps=bw, max_rel_error_vs_float64=err, filter=rows, kla=kla)
    print(f"device {result['device']}, copy {bw:.0f} GB/s, triton vs float64 torch {err:.1e}")
    print("ks.filter (ms; queued / alone): public all fields, kernels all, floor; public mean+var, kernels, floor")
    for r in rows:
        pa, ka, pm, km = (r[k] for k in ("public_all", "kernel_all", "public_mean_var", "kernel_mean_var"))
        print(f"C={r['C']:>5} T={r['T']:>8}  {pa['queued']:7.3f}/{pa['alone']:7.3f} {ka['queued']:7.3f} "
              f"{r['floor_all_ms']:7.3f} ({100 * r['floor_all_ms'] / pa['queued']:4.1f}% of copy)   "
              f"{pm['queued']:7.3f}/{pm['alone']:7.3f} {km['queued']:7.3f} {r['floor_mean_var_ms']:7.3f} "
              f"({100 * r['floor_mean_var_ms'] / pm['queued']:4.1f}%)"
              + (f"   smooth {r['public_smooth']['queued']:7.3f}" if "public_smooth" in r else ""))
    print("fixed cost of a call (public all fields alone - its kernels alone, ms) and what one call dispatches:")
    for r in rows:
        print(f"C={r['C']:>5} T={r['T']:>8}  fixed {r['fixed_all_ms']:7.3f}  "
              f"loglik sum {r['loglik_sum']['queued']:6.3f}  public/kernels queued "
              f"{r['public_all']['queued'] / r['kernel_all']['queued']:5.2f}x all, "
              f"{r['public_mean_var']['queued'] / r['kernel_mean_var']['queued']:5.2f}x mean+var   "
              f"ks.filter {r['counts_all']}  ks.smooth {r['counts_smooth']}")
    print("ks.filter(..., check_finite=False) (no synchronisation; ms, queued / alone; public / kernels queued):")
    for r in rows:
        pa, pm = r["public_all_unchecked"], r["public_mean_var_unchecked"]
        print(f"C={r['C']:>5} T={r['T']:>8}  all {pa['queued']:7.3f}/{pa['alone']:7.3f} "
              f"({pa['queued'] / r['kernel_all']['queued']:5.2f}x)   mean+var {pm['queued']:7.3f}/{pm['alone']:7.3f} "
              f"({pm['queued'] / r['kernel_mean_var']['queued']:5.2f}x)")
    print("ks.filter with theta a device tensor (every field; ms, queued / alone; public / kernels queued):")
    for r in rows:
        pd = r["public_all_device_params"]
        print(f"C={r['C']:>5} T={r['T']:>8}  {pd['queued']:7.3f}/{pd['alone']:7.3f} "
              f"({pd['queued'] / r['kernel_all']['queued']:5.2f}x)")
    for part in ("fwd", "fwd_bwd"):
        d = kla[part]
        print(f"kla_scan {part}: public {d['public']['queued']:.3f}/{d['public']['alone']:.3f} ms, "
              f"kernels {d['kernels']['queued']:.3f}/{d['kernels']['alone']:.3f} ms")
    save(args.out, result)


if __name__ == "__main__":
    main()
