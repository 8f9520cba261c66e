"""Where the time of one KLA :class:`~kalmanscan.nn.SequenceModel` training step goes:
torch.profiler over a few steps (the model and step of :mod:`benchmarks.bench_model`), each
operation's self time summed into groups (projections, conv, scan, norms, casts, syncs, ...).

    python -m benchmarks.probes.profile_model [--batch 8] [--T 2048] [--steps 5] [--compile] [--trace t.json]
        [--variant kla_even]     # the KLA model as bench_model's variant of that name (or kla@bwd_per_sm=16)
        [--variant attention]    # the same model with another of bench_model's mixers, for comparison
        [--kernels]              # also every kernel by name, with its device time per step
    python -m benchmarks.probes.profile_model --quick     # CPU smoke run

On CUDA the table gives each group's self CUDA time (the kernels launched by its operations) and
self CPU time per step, and the number of device-to-host synchronisations; then the 30 operations
with the most CUDA time. Device time is counted once, on the operations (an operation's self CUDA
time is that of the kernels it launched; the kernels' own rows are not added again). ``--shapes``
adds the matrix products (``aten::mm``, ``aten::addmm``, ``aten::bmm``) by input shapes.
``--trace`` writes a Chrome trace of the profiled steps.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from benchmarks.bench_model import build, scan_variant, training_step, variant_changes

GROUPS = [  # (group, substrings of an operation's name); the first match wins
    ("scan", ("kla_scan", "kla_fwd", "kla_bwd", "kla_piece")),
    ("syncs", ("_local_scalar_dense", "aten::item", "Synchronize", "cudaMemcpy", "aten::tolist")),
    ("projections", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "gemm",
                     "aten::embedding")),
    ("optimizer", ("adam", "Optimizer", "_foreach")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss")),
    ("conv", ("aten::addcmul", "aten::cat")),
    ("norms", ("vector_norm", "rsqrt", "aten::pow", "aten::mean", "clamp_min", "aten::norm")),
    ("casts", ("aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous")),
    ("activations", ("silu", "softplus", "sigmoid")),
    ("elementwise", ("aten::mul", "aten::add", "aten::div", "aten::reciprocal", "aten::sub", "aten::exp",
                     "aten::where", "aten::neg", "aten::expm1", "aten::sum", "aten::fill_", "aten::zero")),
]


def group_of(name: str) -> str:
    """The group of an operation or kernel name (``"other"`` when none matches)."""
    return next((group for group, keys in GROUPS if any(k in name for k in keys)), "other")


def print_kernels(events, steps: int) -> None:
    """Every kernel (device-side event) by its full name, with its device time and launches per step,
    the longest first."""
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    print("kernels, per step:")
    for e in kernels:
        print(f"{e.self_device_time_total / steps:9.1f} us {e.count / steps:5.1f} launches  {e.key}")


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.profile_model``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--trace", default=None, help="Chrome trace file of the profiled steps")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run")
    ap.add_argument("--shapes", action="store_true", help="the matrix products by input shapes")
    ap.add_argument("--kernels", action="store_true", help="every kernel by full name, device time per step")
    ap.add_argument("--variant", default="kla",
                    help="the KLA model as benchmarks.bench_model's variant of that name: kla, kla_y_var, "
                         "kla_even or kla@field=value+field=value; or gla, attention")
    return ap


def main(argv: list[str] | None = None):
    ap = parser()
    args = ap.parse_args(argv)
    try:
        variant_changes(args.variant)
    except ValueError as err:
        ap.error(f"--variant: {err}")
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        args.batch, args.T, args.d_model, args.layers, args.vocab, args.steps = 2, 32, 32, 2, 64, 1
    torch.manual_seed(0)
    mixer = "kla" if args.variant.startswith("kla") else args.variant
    model = build(mixer, args.d_model, args.layers, args.vocab, device)
    run = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    tokens = torch.randint(0, args.vocab, (args.batch, args.T + 1), device=device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with scan_variant(args.variant):
        for _ in range(3):
            training_step(run, optimizer, tokens, device)
        if device == "cuda":
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities, record_shapes=args.shapes) as prof:
            for _ in range(args.steps):
                training_step(run, optimizer, tokens, device)
            if device == "cuda":
                torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    events = prof.key_averages()
    device_us, cpu_us, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    syncs = 0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        group = group_of(e.key)
        device_us[group] += getattr(e, "self_device_time_total", 0.0) / args.steps
        cpu_us[group] += e.self_cpu_time_total / args.steps
        calls[group] += e.count // args.steps
        syncs += e.count if e.key == "aten::_local_scalar_dense" else 0
    total = sum(device_us.values()) or 1.0
    print(f"model ({args.variant}): d_model {args.d_model}, {args.layers} layers, B={args.batch}, T={args.T}, "
          f"compiled={args.compile}, {device}; per step:")
    print(f"{'group':14s} {'device ms':>10s} {'share':>7s} {'cpu ms':>9s} {'op calls':>9s}")
    for group in sorted(device_us, key=lambda g: (-device_us[g], -cpu_us[g])):
        print(f"{group:14s} {device_us[group] / 1e3:10.3f} {device_us[group] / total:7.1%} "
              f"{cpu_us[group] / 1e3:9.3f} {calls[group]:9d}")
    print(f"host reads of device values (_local_scalar_dense): {syncs / args.steps:.0f} per step")
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=30))
    if args.kernels:
        print_kernels(events, args.steps)
    if args.shapes:
        products = [e for e in prof.key_averages(group_by_input_shape=True)
                    if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
        products.sort(key=lambda e: -getattr(e, "self_device_time_total", 0.0))
        print("matrix products by input shapes, per step:")
        for e in products[:25]:
            print(f"{e.key:11s} {getattr(e, 'self_device_time_total', 0.0) / args.steps:9.1f} us "
                  f"{e.count // args.steps:4d} calls  {e.input_shapes}")


if __name__ == "__main__":
    main()
