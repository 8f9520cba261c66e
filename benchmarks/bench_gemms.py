"""The matrix products of one :mod:`benchmarks.bench_model` training step, alone: the forward
(``x W^T``), the input gradient (``g W``) and the weight gradient (``g^T x``) of every
``nn.Linear`` in one block of each model (KLA, attention) and the head, at the step's 16384
tokens in bf16, as autograd calls them; and the SwiGLU at its hidden width and at that width
rounded up to multiples of 64 and 256.

    python -m benchmarks run gemms --out gemms.json

Each product is timed queued (:func:`benchmarks.common.timed`, ``--reps`` calls a group) and reported
with its rate in TFLOP/s and the kernel cuBLAS ran (torch.profiler). The rows of a bf16 operand
must start 16 bytes apart for the tensor-core kernels of sm_80 and later: a row of an odd number
of elements does not.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks.common import save, timed
from benchmarks.bench_model import build
from kalmanscan.nn.model import SwiGLU

TOKENS, D_MODEL, VOCAB = 16384, 512, 4096


def kernel_of(fn):
    """The names of the CUDA kernels one call of ``fn`` launches, the longest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                    key=lambda e: -e.self_device_time_total)
    return [e.key for e in events]


def products(name, linear, reps):
    """Rows for the three products of ``linear`` at :data:`TOKENS` tokens."""
    w = linear.weight.detach().to(torch.bfloat16)
    n_out, n_in = w.shape
    x = torch.randn(TOKENS, n_in, device=w.device, dtype=torch.bfloat16)
    g = torch.randn(TOKENS, n_out, device=w.device, dtype=torch.bfloat16)
    calls = dict(forward=lambda: torch.nn.functional.linear(x, w), input_grad=lambda: torch.mm(g, w),
                 weight_grad=lambda: torch.mm(g.t(), x))
    rows = []
    for product, fn in calls.items():
        ms = timed(fn, reps=reps)
        flops = 2.0 * TOKENS * n_in * n_out
        rows.append(dict(layer=name, product=product, n_in=n_in, n_out=n_out, ms=ms,
                         tflops=flops / (ms * 1e-3) / 1e12, kernels=kernel_of(fn)))
        print(f"{name:28s} {product:12s} {n_in:5d} -> {n_out:5d} {ms * 1e3:8.1f} us "
              f"{rows[-1]['tflops']:6.1f} TFLOP/s  {rows[-1]['kernels'][0][:60]}", flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run gemms``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--reps", type=int, default=20)
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    device = "cuda"
    rows = []
    for mixer in ("kla", "attention"):
        model = build(mixer, D_MODEL, 1, VOCAB, device, mlp_multiple_of=1)
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and (mixer == "kla" or ".mixer." in name):
                rows += products(f"{mixer}:{name}", module, args.reps)
    for multiple in (1, 64, 256):
        mlp = SwiGLU(D_MODEL, multiple_of=multiple, device=device)
        for name in ("w_in", "w_out"):
            rows += products(f"swiglu hidden {mlp.w_out.in_features}:{name}", getattr(mlp, name), args.reps)
    save(args.out, dict(device=torch.cuda.get_device_name(), tokens=TOKENS, rows=rows))


if __name__ == "__main__":
    main()
