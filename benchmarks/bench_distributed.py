"""Benchmark of sequence parallelism (ks.distributed) under torchrun: one long series, one model.

    torchrun --nproc-per-node N -m benchmarks run distributed --out result.json            # GPUs, NCCL
    torchrun --nproc-per-node 2 -m benchmarks run distributed --device cpu --log2-steps 16 \\
        --channels 8 --seq 512 --d-model 32 --out cpu.json                                  # CPUs, gloo
    python -m benchmarks run distributed --out one.json                                    # one process

(``torchrun ... benchmarks/bench_distributed.py ...`` runs the same, with the repository root on
``PYTHONPATH``.)

Part 1, the filter: one series of ``2^log2_steps`` steps x ``channels`` (float32, 5% missing)
split evenly across the N ranks, :func:`kalmanscan.distributed.filter` forward (no gradient).
Part 2, a KLA :class:`~kalmanscan.nn.SequenceModel` training step (forward, cross-entropy,
backward, gradient all-reduce, AdamW) on ``batch`` sequences of ``seq`` tokens split across ranks
(:func:`kalmanscan.distributed.sequence_parallel`).

Each part reports: the time per call (median over ``reps`` of the slowest rank, after warm-up),
the same work on one process over the whole sequence (rank 0 alone; ``null`` if it does not fit),
speed-up and scaling efficiency (speed-up / N), the local pass without exchange and the summary
product a non-last rank adds (the last rank, hence N = 1, computes none; the backend's public
``summary``: for the filter that of the backend the local pass runs, for KLA the fused kernel on
GPUs and the torch product), the bytes each rank contributes to the all-gathers per call
(each rank receives N - 1 times that) and what the backward exchanges, the device copy bandwidth
measured in the same run and the filter's bytes per element (y read, the 9 posterior fields
written) over its time as a fraction of it. Correctness checks compare every rank's rows with one
process on the whole sequence (max relative error): the filter at a smaller size, the model's
logits at the benchmark's size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value  # NVLink multicast stays off (the device machines' rule)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import commit  # noqa: E402
import kalmanscan as ks  # noqa: E402
from kalmanscan.problem.prepare import prepare  # noqa: E402
from kalmanscan.ops.filter import get_backend, resolve_backend  # noqa: E402
from kalmanscan.ops.kla import torch as kla_torch  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """The command line (the same on every rank)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--log2-steps", type=int, default=26,
                    help="series length T = 2^this, all ranks")
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--backend", default="auto", help="filter and KLA scan backend")
    ap.add_argument("--check-log2-steps", type=int, default=16, help="size of the correctness check")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-state", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence, all ranks")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-single", action="store_true", help="do not time one process")
    ap.add_argument("--parts", default="filter,model", help="comma-separated: filter, model")
    ap.add_argument("--out", default=None, help="JSON file written by rank 0")
    ap.add_argument("--commit", default=None, help="recorded commit (default: git rev-parse HEAD)")
    return ap


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps, collective=True):
    """Median over ``reps`` of the per-call time in ms (the slowest rank's when collective)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        if collective:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    if collective:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def alone(rank, fn):
    """Run ``fn`` on rank 0 only (others wait); its result broadcast as a float (or None)."""
    value = None
    if rank == 0:
        try:
            value = fn()
        except torch.cuda.OutOfMemoryError:
            value = None
            torch.cuda.empty_cache()
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def copy_gbps(device):
    """Device copy bandwidth (bytes read + written per second, GB/s) of a 1 GiB (GPU) or 256 MiB
    (CPU) buffer."""
    n = (1 << 28) if device.type == "cuda" else (1 << 26)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, 10, collective=False)
    return 2 * n * 4 / ms / 1e6


def series(T, C, lo, hi, device, seed=0):
    """Rows ``lo:hi`` of one random float32 series ``(T, C)`` (5% missing) and its parameters."""
    g = torch.Generator(device=device).manual_seed(seed)
    theta = torch.rand(C, generator=g, device=device) * 0.1 + 0.01
    kw = dict(theta=theta, sigma=torch.rand(C, generator=g, device=device) + 0.5,
              obs_var=torch.rand(C, generator=g, device=device) + 0.1)
    g.manual_seed(seed + 1 + lo)
    y = torch.randn(hi - lo, C, generator=g, device=device)
    y[torch.rand(hi - lo, C, generator=g, device=device) < 0.05] = float("nan")
    return y, kw


def filter_part(args, rank, world, device):
    T, C = 1 << args.log2_steps, args.channels
    per = T // world
    lo, hi = rank * per, (rank + 1) * per if rank < world - 1 else T
    y, kw = series(T, C, lo, hi, device)
    out = {"T": T, "C": C, "T_local": hi - lo}
    with torch.no_grad():
        out["ms"] = timed(lambda: ks.distributed.filter(y, backend=args.backend, **kw), device, args.reps)
        out["local_ms"] = timed(lambda: ks.filter(y, backend=args.backend, **kw), device, args.reps)
        out["summary_ms"] = summary_ms(prepare(y, backend=args.backend, **kw), args, device)
        n_fields = sum(1 for v in ks.filter(y[:2], backend=args.backend, **kw).__dict__.values()
                       if isinstance(v, torch.Tensor) and v.ndim == 2)
        if world > 1 and not args.skip_single:
            def single():
                full, _ = series(T, C, 0, T, device)
                return timed(lambda: ks.filter(full, backend=args.backend, **kw), device, args.reps,
                             collective=False)
            out["single_ms"] = alone(rank, single)
        else:
            out["single_ms"] = out["local_ms"] if world == 1 else None
        out["bytes_per_element"] = 4 * (1 + n_fields)
        out["bytes_sent_per_rank"] = {"agreement": 5 * 8, "summaries": 7 * C * 4}
    return out


def summary_ms(p, args, device):
    """Time of the summary of the problem ``p`` (the public ``summary`` of the backend that
    ``args.backend`` stands for on ``device``)."""
    backend = get_backend(resolve_backend(args.backend, device))
    return timed(lambda: backend.summary(p), device, args.reps)


def filter_check(args, rank, world, device):
    """Max relative error of every rank's rows against one process on the whole series."""
    T, C = 1 << args.check_log2_steps, args.channels
    full, kw = series(T, C, 0, T, device, seed=5)
    per = T // world
    lo, hi = rank * per, (rank + 1) * per if rank < world - 1 else T
    with torch.no_grad():
        ref = ks.filter(full, backend=args.backend, **kw)
        post = ks.distributed.filter(full[lo:hi], backend=args.backend, **kw)
    err = max(float((getattr(post, k) - getattr(ref, k)[lo:hi]).abs().max()
                    / getattr(ref, k)[lo:hi].abs().max()) for k in ("mean", "var", "logliks"))
    t = torch.tensor([err], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def model_part(args, rank, world, device):
    torch.manual_seed(0)
    model = ks.nn.SequenceModel(args.vocab, args.d_model, args.layers, mixer="kla", d_state=args.d_state,
                                backend=args.backend, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    L = args.seq
    per = L // world
    g = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, L + 1), generator=g, device=device)
    lo, hi = rank * per, (rank + 1) * per if rank < world - 1 else L

    def step():
        with ks.distributed.sequence_parallel(model):
            logits = model(tokens[:, lo:hi])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, lo + 1:hi + 1].flatten(), reduction="sum")
        (loss / (args.batch * L)).backward()
        ks.distributed.reduce_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"batch": args.batch, "L": L, "L_local": hi - lo, "d_model": args.d_model,
           "layers": args.layers, "M": model.blocks[0].mixer.d_inner, "S": args.d_state,
           "params": sum(p.numel() for p in model.parameters())}
    with torch.no_grad():
        ref = model(tokens[:, :L])[:, lo:hi]
        with ks.distributed.sequence_parallel(model):
            err = float((model(tokens[:, lo:hi]) - ref).abs().max() / ref.abs().max())
        del ref
    t = torch.tensor([err], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["logits_check_max_rel_err"] = float(t)
    out["ms"] = timed(step, device, args.reps)

    def local_step():
        logits = model(tokens[:, lo:hi])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, lo + 1:hi + 1].flatten()).backward()
        opt.zero_grad(set_to_none=True)

    out["local_ms"] = timed(local_step, device, args.reps)
    B, M, S = args.batch, out["M"], args.d_state
    x = [torch.rand(B, hi - lo, M, device=device), torch.rand(B, hi - lo, M, device=device) + 0.5,
         F.normalize(torch.randn(B, hi - lo, S, device=device), dim=-1),
         F.normalize(torch.randn(B, hi - lo, S, device=device), dim=-1),
         torch.rand(M, S, device=device) * 0.5 + 0.45, torch.rand(M, S, device=device) * 0.1]
    with torch.no_grad():
        out["summary_torch_fwd_ms_per_layer"] = timed(lambda: kla_torch.summary(*x, torch.float32), device,
                                                      args.reps)
        if device.type == "cuda":
            from kalmanscan.ops.kla.triton import backend as kla_triton
            out["summary_fused_fwd_ms_per_layer"] = timed(lambda: kla_triton.summary(*x, torch.float32),
                                                          device, args.reps)
    if world > 1 and not args.skip_single:
        def single():
            def full_step():
                logits = model(tokens[:, :L])
                F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return timed(full_step, device, args.reps, collective=False)
        out["single_ms"] = alone(rank, single)
    else:
        out["single_ms"] = out["ms"] if world == 1 else None
    halo = 4 * B * (model.blocks[0].mixer.d_conv - 1) * M
    summary = 7 * B * M * S * 4
    agreement = 3 * 8 + 2 * 8  # kla_scan's and the layer's input agreement
    out["bytes_sent_per_rank"] = {"forward_per_kla_layer": halo + summary + agreement,
                                  "forward_all_layers": (halo + summary + agreement) * args.layers,
                                  "backward_all_layers": (world * halo + 5 * B * M * S * 4) * args.layers,
                                  "gradient_all_reduce_buffer": 4 * out["params"]}
    return out


def scaling(part, world):
    if part.get("single_ms"):
        part["speedup"] = part["single_ms"] / part["ms"]
        part["efficiency"] = part["speedup"] / world
    return part


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        os.environ.setdefault(name, value)  # one process when not started by torchrun
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if want_cuda else "gloo", device_id=device if want_cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if want_cuda else "cpu",
              "commit": args.commit or commit(), "world": world, "backend": dist.get_backend(),
              "torch": torch.__version__,
              "copy_GBps": copy_gbps(device)}
    parts = set(args.parts.split(","))
    if "filter" in parts:
        result["filter_check_max_rel_err"] = filter_check(args, rank, world, device)
        result["filter"] = scaling(filter_part(args, rank, world, device), world)
        f = result["filter"]
        f["GBps"] = f["bytes_per_element"] * f["T_local"] * f["C"] / f["ms"] / 1e6
        f["fraction_of_copy"] = f["GBps"] / result["copy_GBps"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "model" in parts:
        result["kla_model"] = scaling(model_part(args, rank, world, device), world)
    if device.type == "cuda":
        result["peak_GiB_rank0"] = torch.cuda.max_memory_allocated(device) / 2**30
    if rank == 0:
        text = json.dumps(result, indent=2)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
