"""The KLA scan and a KLA model on a CPU: the compiled loops (``backend="cpu"``, what ``"auto"``
picks for CPU tensors) beside the torch backends a user would otherwise get, in one process.

    python -m benchmarks run kla_cpu --out kla_cpu.json
    python -m benchmarks run kla_cpu --quick          # smoke run: tiny shapes

Scan rows: the public ``kla_scan`` on float32 CPU tensors, ``S = 16``, forward without autograd and
forward plus backward (all six inputs requiring gradients, loss on ``y`` and ``y_var``), for the
backends ``cpu``, ``recurrent`` (token by token in torch operations, the earlier default on a CPU
for wide scans) and ``torch`` (the time-parallel scan, the earlier default for narrow ones; skipped
where its ``(B, L, M, S)`` intermediates would pass a few GB). Every backend's outputs and gradients
are checked against the cpu backend's first. The hardware limit beside them: the forward takes one
division per filter and token, so its ceiling is the machine's rate of vectorised float32
divisions ``1 / (1 + a b)`` on all threads (measured here, :func:`division_rate`); % div is the
forward's filter updates per second over that rate.

Model rows: a training step (forward, cross-entropy, backward, AdamW; float32, no autocast) of
:class:`kalmanscan.nn.SequenceModel`, d_model 128, 2 layers, vocabulary 256, B = 8, T = 512, with
the KLA mixer on the cpu backend, on the recurrent one, and the attention mixer (SDPA) for scale.
Wall-clock medians; the first call of each configuration (numba's compilation or cache load) is
not timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch
from numba import njit, prange

from benchmarks.bench_model import build, time_steps
from benchmarks.common import commit, save, wall_times
from kalmanscan.nn import KLA
from kalmanscan.ops.kla import kla_scan

SCANS = [(8, 512, 256, 16), (2, 2048, 128, 16), (1, 8192, 64, 16)]
QUICK_SCANS = [(2, 70, 40, 16)]
BACKENDS = ("cpu", "recurrent", "torch")
TORCH_MAX_ELEMENTS = 1 << 23     # B L M S beyond which the time-parallel scan is not run
MODEL = dict(d_model=128, layers=2, vocab=256, batch=8, T=512)
QUICK_MODEL = dict(d_model=16, layers=1, vocab=32, batch=2, T=32)


@njit(parallel=True, cache=True, error_model="numpy")
def _divisions(a, b, out, repeats):
    threads, n = out.shape
    one = a[0] - a[0] + 1
    for w in prange(threads):
        for _ in range(repeats):
            for i in range(n):
                out[w, i] = one / (one + a[i] * b[i] * out[w, i])


def division_rate(seconds: float = 0.5) -> float:
    """Vectorised float32 divisions per second on numba's threads (each thread an L1-resident
    buffer of 4096 elements, the loop the forward's ``r = 1 / (1 + phi P)``)."""
    import numba

    n, threads = 4096, numba.get_num_threads()
    rng = np.random.default_rng(0)
    a, b = (rng.uniform(0.5, 1.5, n).astype(np.float32) for _ in range(2))
    out = np.ones((threads, n), np.float32)
    _divisions(a, b, out, 1)
    repeats = 64
    while True:
        t0 = time.perf_counter()
        _divisions(a, b, out, repeats)
        dt = time.perf_counter() - t0
        if dt > seconds:
            return threads * n * repeats / dt
        repeats *= 2


def scan_inputs(B, L, M, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    return [torch.randn(B, L, M, generator=g), 0.1 + 2 * torch.rand(B, L, M, generator=g),
            unit(torch.randn(B, L, S, generator=g)), unit(torch.randn(B, L, S, generator=g)),
            0.6 + 0.4 * torch.rand(M, S, generator=g), 0.05 + torch.rand(M, S, generator=g)]


def median_s(fn, repeats):
    return statistics.median(wall_times(fn, repeats))


def fwd_bwd(xs, backend):
    """Outputs and gradients of ``y.sum() + y_var.sum()`` (a fresh graph each call)."""
    xs = [x.detach().requires_grad_() for x in xs]
    y, y_var = kla_scan(*xs, backend=backend)
    grads = torch.autograd.grad(y.sum() + y_var.sum(), xs)
    return [y.detach(), y_var.detach(), *grads]


def scan_rows(shape, repeats, rate):
    B, L, M, S = shape
    xs = scan_inputs(*shape)
    ref = fwd_bwd(xs, "cpu")
    rows = []
    for backend in BACKENDS:
        if backend == "torch" and B * L * M * S > TORCH_MAX_ELEMENTS:
            continue
        got = fwd_bwd(xs, backend)
        err = max(float((a - r).abs().max() / r.abs().max()) for a, r in zip(got, ref))
        slow = backend != "cpu"
        with torch.no_grad():
            fwd = median_s(lambda: kla_scan(*xs, backend=backend), 1 if slow else repeats)
        both = median_s(lambda: fwd_bwd(xs, backend), 1 if slow else repeats)
        n = B * L * M * S
        rows.append(dict(B=B, L=L, M=M, S=S, backend=backend, fwd_ms=fwd * 1e3, fwd_bwd_ms=both * 1e3,
                         fwd_updates_per_s=n / fwd, fwd_bwd_updates_per_s=n / both,
                         fwd_pct_division_rate=100 * n / fwd / rate, max_rel_diff_vs_cpu=err))
        print(f"{B:>2} {L:>5} {M:>4} {S:>3} {backend:>9}: fwd {fwd * 1e3:9.2f} ms "
              f"({100 * n / fwd / rate:5.1f}% of div rate)  fwd+bwd {both * 1e3:9.2f} ms  diff {err:.1e}", flush=True)
    return rows


def model_rows(cfg, groups, steps):
    rows = []
    for mixer, backend in (("kla", "cpu"), ("kla", "recurrent"), ("attention", None)):
        torch.manual_seed(0)
        model = build(mixer, cfg["d_model"], cfg["layers"], cfg["vocab"], "cpu")
        for m in model.modules():
            if isinstance(m, KLA):
                m.backend = backend
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["T"] + 1))

        def step():
            optimizer.zero_grad(set_to_none=True)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()

        ms, times = time_steps(step, "cpu", steps, groups, 1)
        tokens_per_s = cfg["batch"] * cfg["T"] / ms * 1e3
        rows.append(dict(mixer=mixer, backend=backend, **cfg, step_ms=ms, group_ms=times, tokens_per_s=tokens_per_s,
                         params=sum(p.numel() for p in model.parameters())))
        print(f"model {mixer:>9} {str(backend):>9}: {ms:8.1f} ms a step, {tokens_per_s:9.0f} tokens/s", flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run kla_cpu``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny shapes")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    import numba

    rate = division_rate(0.05 if args.quick else 0.5)
    print(f"{numba.get_num_threads()} threads, {rate:.3e} float32 divisions/s (vectorised, all threads)")
    scans = []
    for shape in QUICK_SCANS if args.quick else SCANS:
        scans += scan_rows(shape, 1 if args.quick else args.repeats, rate)
    models = model_rows(QUICK_MODEL if args.quick else MODEL, 1 if args.quick else 3, 1 if args.quick else 3)
    record = dict(commit=commit(), machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                  threads=numba.get_num_threads(), torch=torch.__version__, numba=numba.__version__,
                  division_rate=rate, scans=scans, models=models)
    save(args.out, record)


if __name__ == "__main__":
    main()
