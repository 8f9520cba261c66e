"""GPU benchmark of ``kla_scan``: correctness on the device, launch-shape sweep, timings.

    python -m benchmarks run kla --out kla.json [--sweep] [--no-torch] [--no-fla]

1. Checks the triton backend against the float64 sequential recursion ON THE GPU (values and the
   gradients of all eight inputs), at shapes with several chunks, ragged channel blocks and a
   non-power-of-two state size, for every launch shape it later times.
2. Measures the FP32 rate of this GPU in the same run: a Triton kernel of independent FMA chains and
   a float32 matrix product with TF32 off; the higher is the reference "FP32 issue rate".
3. Times forward (no grad) and forward+backward, peak extra memory, state updates per second, and
   the fraction of the FP32 rate that the forward's arithmetic represents (``FWD_FP32_OPS`` per
   state update, counted from ``kernels/kla/fwd.py``), at the issue's three shapes, with and
   without the forward's time split (``pieces=1``); side by side with the torch backend and, when
   installed, fla's ``chunk_gla`` at the matched width (d_model 512: H=4, K=64, V=128, bf16).
   Times are per call with launches queued ahead (:func:`timed`: calls back to back, as in a
   training loop; the GPU's time) and, as ``*_per_call_ms``, each call alone after a
   synchronisation (:func:`timed_per_call`: the host's launch latency added, the GPU idle
   meanwhile). The kernels are launched through :func:`kalmanscan.ops.kla.triton.kla_scan_triton`
   with the timed :class:`KLAConfig` (the sweep's best with ``--sweep``, else the shape's
   ``launch_config``); the ``triton_public_api`` rows time the public
   ``kla_scan(..., backend="triton")``, which launches with ``launch_config``'s choice.

    python -m benchmarks run kla --out kla.json --overhead   # the public call's host overhead only
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import triton
import triton.language as tl

from benchmarks.common import commit, make_inputs, save, timed
from kalmanscan.ops.kla import kla_scan, kla_scan_unchecked, validate
from kalmanscan.ops.kla.reference import kla_scan_sequential
from kalmanscan.ops.kla.triton.library import SPLIT_CONFIG, launch_config
from kalmanscan.ops.kla.triton.backend import DEFAULT_CONFIG, KLAConfig, kla_scan_triton

SHAPES = [(8, 2048, 1024, 16), (4, 4096, 2048, 16), (1, 16384, 1024, 16)]
# Per state update in the forward: lam_v*k^2, decay^2 + noise*lam (fma), rho*lam + phi (fma),
# rho*decay, lam_v v * k, fma for eta, q*inv, two fmas for y and y_var, and two divisions, each a
# reciprocal (MUFU) plus one multiply: 11 FP32 pipe instructions and 2 MUFU.
FWD_FP32_OPS = 11
TOL = 2e-5


def timed_per_call(fn, reps=20, warmup=3):
    """Median milliseconds of ``fn()`` timed alone (synchronised before each call): the GPU's time
    plus the host's launch latency, during which the GPU idles (:func:`timed` with groups of one)."""
    return timed(fn, reps=1, warmup=warmup, groups=reps)


def peak_extra_mb(fn):
    """Peak device memory allocated by ``fn()`` beyond what was allocated before, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def check(B, L, M, S, config, seed=0, grads=True, device="cuda"):
    """Max relative errors of the triton outputs (and all gradients, of a random weighting of the
    outputs) against float64 on the GPU; a ``config`` without the variance is checked without
    ``y_var``, whose place it leaves ``None``."""
    xs = make_inputs(B, L, M, S, seed=seed, state=True, device=device)
    names = ["y", "y_var", "lam", "eta"]
    keep = [0, 1, 2, 3] if config is None or config.variance else [0, 2, 3]
    if not grads:
        with torch.no_grad():
            ref = kla_scan_sequential(*[x.double() for x in xs])
            out = kla_scan_triton(*xs, config=config)
        errs = {names[i]: rel(out[i], ref[i]) for i in keep}
        return max(errs.values()), errs
    g = torch.Generator(device=device).manual_seed(seed + 1)

    def run(fn, inputs):
        inputs = [x.detach().clone().requires_grad_() for x in inputs]
        result = fn(inputs)
        outs = [result[i] for i in keep]
        w = [torch.randn(o.shape, device=device, dtype=torch.float64, generator=g) for o in outs]
        sum((o.double() * ww).sum() for o, ww in zip(outs, w)).backward()
        return [o.detach() for o in outs], [x.grad for x in inputs]

    g.manual_seed(seed + 1)
    ref_o, ref_g = run(lambda a: kla_scan_sequential(*a), [x.double() for x in xs])
    g.manual_seed(seed + 1)
    out_o, out_g = run(lambda a: kla_scan_triton(*a, config=config), xs)
    labels = [names[i] for i in keep] + ["gv", "glam_v", "gk", "gq", "gdecay", "gnoise", "glam0", "geta0"]
    errs = dict(zip(labels, [rel(a, b) for a, b in zip(out_o + out_g, ref_o + ref_g)]))
    return max(errs.values()), errs


@triton.jit
def _fma_kernel(out_ptr, n_iter, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = offs.to(tl.float32) * 1e-9
    a0, a1, a2, a3 = x + 0.1, x + 0.2, x + 0.3, x + 0.4
    a4, a5, a6, a7 = x + 0.5, x + 0.6, x + 0.7, x + 0.8
    for _ in range(n_iter):
        a0 = tl.fma(a0, 0.999, 0.001)
        a1 = tl.fma(a1, 0.999, 0.001)
        a2 = tl.fma(a2, 0.999, 0.001)
        a3 = tl.fma(a3, 0.999, 0.001)
        a4 = tl.fma(a4, 0.999, 0.001)
        a5 = tl.fma(a5, 0.999, 0.001)
        a6 = tl.fma(a6, 0.999, 0.001)
        a7 = tl.fma(a7, 0.999, 0.001)
    tl.store(out_ptr + offs, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7)


def fp32_rates():
    """FP32 instructions per second: an FMA-chain kernel, and a non-TF32 float32 matmul."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block, n_iter = 1024, 4096
    n_prog = sms * 32
    out = torch.empty(n_prog * block, device="cuda")
    ms = timed(lambda: _fma_kernel[(n_prog,)](out, n_iter, BLOCK=block, num_warps=4), reps=5)
    fma_rate = n_prog * block * 8 * n_iter / (ms * 1e-3)
    torch.backends.cuda.matmul.allow_tf32 = False
    n = 8192
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    ms_mm = timed(lambda: a @ b, reps=5, warmup=1)
    mm_rate = n**3 / (ms_mm * 1e-3)
    return dict(fma_kernel_instr_per_s=fma_rate, fp32_matmul_fma_per_s=mm_rate,
                fp32_instr_per_s=max(fma_rate, mm_rate))


def bench_triton(shape, config, fp32_rate, public=True):
    """Times of the kernels launched with ``config``, or with ``public`` of the public call (which
    launches with ``launch_config``'s choice)."""
    B, L, M, S = shape
    xs = make_inputs(B, L, M, S)
    updates = B * L * M * S
    call = (lambda a: kla_scan(*a, backend="triton")) if public else \
        (lambda a: kla_scan_triton(*a, config=config)[:2])
    with torch.no_grad():
        fwd = timed(lambda: call(xs))
        fwd_alone = timed_per_call(lambda: call(xs))
        fwd_mem = peak_extra_mb(lambda: call(xs))
    xg = [x.clone().requires_grad_() for x in xs]
    gy, gyv = torch.randn(B, L, M, device="cuda"), torch.randn(B, L, M, device="cuda")

    def fwd_bwd():
        y, y_var = call(xg)
        torch.autograd.backward((y, y_var), (gy, gyv))
        for x in xg:
            x.grad = None

    fb = timed(fwd_bwd, reps=10)
    fb_alone = timed_per_call(fwd_bwd, reps=10)
    fb_mem = peak_extra_mb(fwd_bwd)
    return dict(fwd_ms=fwd, fwd_bwd_ms=fb, fwd_per_call_ms=fwd_alone, fwd_bwd_per_call_ms=fb_alone,
                fwd_peak_extra_mb=fwd_mem, fwd_bwd_peak_extra_mb=fb_mem,
                fwd_updates_per_s=updates / (fwd * 1e-3), fwd_bwd_updates_per_s=updates / (fb * 1e-3),
                fwd_pct_fp32=100.0 * FWD_FP32_OPS * updates / (fwd * 1e-3) / fp32_rate)


def bench_torch(shape):
    B, L, M, S = shape
    res = {}
    try:
        xs = make_inputs(B, L, M, S)
        with torch.no_grad():
            res["fwd_ms"] = timed(lambda: kla_scan(*xs, backend="torch"), reps=3, warmup=1, groups=1)
            res["fwd_peak_extra_mb"] = peak_extra_mb(lambda: kla_scan(*xs, backend="torch"))
        xg = [x.clone().requires_grad_() for x in xs]

        def fwd_bwd():
            y, y_var = kla_scan(*xg, backend="torch")
            (y.sum() + y_var.sum()).backward()

        res["fwd_bwd_ms"] = timed(fwd_bwd, reps=3, warmup=1, groups=1)
        res["fwd_bwd_peak_extra_mb"] = peak_extra_mb(fwd_bwd)
    except torch.cuda.OutOfMemoryError as e:
        res["oom"] = str(e).split("\n")[0][:200]
    torch.cuda.empty_cache()
    return res


def bench_fla(B, L, H=4, K=64, V=128):
    try:
        from fla.ops.gla import chunk_gla
    except ImportError as e:
        return dict(error=f"fla not importable: {e}")
    kw = dict(device="cuda", dtype=torch.bfloat16)
    q, k = torch.randn(B, L, H, K, **kw), torch.randn(B, L, H, K, **kw)
    v = torch.randn(B, L, H, V, **kw)
    g = torch.nn.functional.logsigmoid(torch.randn(B, L, H, K, device="cuda")).to(torch.bfloat16)
    with torch.no_grad():
        fwd = timed(lambda: chunk_gla(q, k, v, g))
        fwd_alone = timed_per_call(lambda: chunk_gla(q, k, v, g))
    xg = [x.clone().requires_grad_() for x in (q, k, v, g)]
    do = torch.randn(B, L, H, V, **kw)

    def fwd_bwd():
        o, _ = chunk_gla(*xg)
        o.backward(do)
        for x in xg:
            x.grad = None

    fb = timed(fwd_bwd, reps=10)
    return dict(fwd_ms=fwd, fwd_bwd_ms=fb, fwd_per_call_ms=fwd_alone,
                fwd_bwd_per_call_ms=timed_per_call(fwd_bwd, reps=10), fwd_bwd_peak_extra_mb=peak_extra_mb(fwd_bwd))


def host_overhead(shape, n=50):
    """Where the public ``kla_scan`` spends the time its kernels do not: per-call CUDA-event medians
    (the sync of the validation stalls the queue inside the timed interval) and the wall time of
    ``n`` calls back to back (a training loop's view), for the kernels alone, the validation alone,
    the public call and the unchecked call the layer makes (no synchronisation); milliseconds."""
    xs = make_inputs(*shape)
    calls = dict(kernels=lambda: kla_scan_triton(*xs)[:2], validation=lambda: validate(*xs, None, "triton"),
                 public=lambda: kla_scan(*xs, backend="triton"),
                 unchecked=lambda: kla_scan_unchecked(*xs, backend="triton"))
    res = {}
    with torch.no_grad():
        for name, fn in calls.items():
            res[name + "_per_call_ms"] = timed_per_call(fn)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            res[name + "_back_to_back_ms"] = 1e3 * (time.perf_counter() - t0) / n
            t0 = time.perf_counter()
            fn()
            res[name + "_host_ms"] = 1e3 * (time.perf_counter() - t0)
            torch.cuda.synchronize()
    return res


def sweep(shape, configs, fp32_rate, time_bwd):
    """Time each launch shape (forward, or forward+backward) after checking it on the GPU."""
    rows = []
    for cfg in configs:
        row = dict(config=cfg.__dict__)
        try:
            row["check_max_rel_err"] = check(2, 150, 40, 16, cfg, grads=time_bwd)[0]
            res = bench_triton(shape, cfg, fp32_rate, public=False) if time_bwd else None
            if res is None:
                B, L, M, S = shape
                xs = make_inputs(B, L, M, S)
                with torch.no_grad():
                    row["fwd_ms"] = timed(lambda: kla_scan_triton(*xs, config=cfg))
            else:
                row.update(res)
        except Exception as e:  # a launch shape that fails to compile is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run kla``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--shapes", default="012", help="which of SHAPES to time, by index")
    ap.add_argument("--overhead", action="store_true", help="only the public call's host overhead")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    result = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(),
                  commit=commit(),
                  default_config=DEFAULT_CONFIG.__dict__)
    result["fp32"] = fp32_rates()
    rate = result["fp32"]["fp32_instr_per_s"]
    print(json.dumps(result), flush=True)

    checks = {}
    for name, (shape, cfg) in {
        "default B2 L300 M40 S16": ((2, 300, 40, 16), DEFAULT_CONFIG),
        "default B3 L129 M37 S5": ((3, 129, 37, 5), DEFAULT_CONFIG),
        "unrolled x2 B2 L300 M40 S16": ((2, 300, 40, 16), KLAConfig(unroll=2, bwd_unroll=2)),
        "time split x4 B2 L300 M40 S16": ((2, 300, 40, 16), KLAConfig(pieces=4, bwd_pieces=4)),
        "states first B2 L300 M40 S16": ((2, 300, 40, 16), SPLIT_CONFIG),
    }.items():
        checks[name] = check(*shape, cfg)
    result["gpu_check"] = {k: dict(max_rel_err=v[0], errors=v[1], passed=v[0] < TOL)
                           for k, v in checks.items()}
    print(json.dumps(result["gpu_check"]), flush=True)

    save(args.out, result)
    if args.overhead:
        result["host_overhead"] = host_overhead(SHAPES[0])
        print(json.dumps(result["host_overhead"]), flush=True)
        save(args.out, result)
        return
    if args.sweep:
        fwd_cfgs = [KLAConfig(block_m=bm, num_warps=w, pieces=p, stages=st)
                    for bm, w, p, st in ((16, 2, None, 5), (16, 2, None, 3), (16, 2, None, 4), (16, 2, None, 6),
                                         (16, 2, None, 8), (16, 4, None, 5), (8, 2, None, 5), (32, 4, None, 5),
                                         (16, 2, 2, 5))]
        result["sweep_fwd"] = sweep(SHAPES[0], fwd_cfgs, rate, time_bwd=False)
        best = fastest(result["sweep_fwd"], "fwd_ms")
        save(args.out, result)
        bwd_cfgs = [KLAConfig(**{**best, "bwd_block_m": bm, "bwd_num_warps": w, "bwd_pieces": p, "bwd_stages": st})
                    for bm, w, p, st in ((8, 1, None, 6), (8, 1, None, 3), (8, 1, None, 5), (8, 1, None, 8),
                                         (8, 2, None, 6), (16, 2, None, 6), (8, 1, 2, 6))]
        result["sweep_fwd_bwd"] = sweep(SHAPES[0], bwd_cfgs, rate, time_bwd=True)
        result["best_config"] = fastest(result["sweep_fwd_bwd"], "fwd_bwd_ms")
        config = KLAConfig(**result["best_config"])
        save(args.out, result)
    else:
        config = None
    result["timed_config"] = "launch_config" if config is None else config.__dict__

    result["table"] = []
    for shape in [SHAPES[int(i)] for i in args.shapes]:
        row = dict(shape=dict(zip("BLMS", shape)))
        if not args.sweep:
            config = launch_config(*shape[:3], torch.device("cuda"))
            row["config"] = config.__dict__
        row["triton"] = bench_triton(shape, config, rate, public=False)
        row["triton_public_api"] = bench_triton(shape, config, rate, public=True)
        row["triton_no_time_split"] = bench_triton(
            shape, KLAConfig(**{**config.__dict__, "pieces": 1, "bwd_pieces": 1}), rate, public=False)
        if not args.no_torch:
            row["torch"] = bench_torch(shape)
        if not args.no_fla:
            row["fla_chunk_gla"] = bench_fla(shape[0], shape[1])
        print(json.dumps(row), flush=True)
        result["table"].append(row)
        save(args.out, result)


def fastest(rows, key):
    """The config of the fastest row that ran and passed its GPU check."""
    ok = [r for r in rows if key in r and r["check_max_rel_err"] < TOL]
    return min(ok, key=lambda r: r[key])["config"]


if __name__ == "__main__":
    main()
