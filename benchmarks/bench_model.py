"""Training throughput of the same :class:`kalmanscan.nn.SequenceModel` with the KLA, fla GLA and
attention (SDPA) mixers, in one process: tokens per second of a whole training step.

    python -m benchmarks run model --out model.json [--compile] [--mixers kla,gla,attention]
    python -m benchmarks run model --quick          # CPU smoke run: tiny shapes, a few steps

A step is forward, cross-entropy, backward and an AdamW step under bf16 autocast, synchronised;
:func:`time_steps` reports the median over groups of steps, printed with the groups' range (a
machine whose groups spread widely cannot decide an A/B of a few percent). Every mixer gets the
same model around it (d_model 512, 4 layers, SwiGLU of hidden width 1408, vocabulary 4096; ``--mlp-multiple-of 1``
for the unrounded width 1365 that runs before 2026-12-05 used) and the same tokens per step at each
length (B=8 at T=2048, B=2 at T=8192); parameter counts are reported beside the speed. Each model is
compiled afresh (``torch._dynamo.reset()``), so none inherits recompilations or dynamic shapes from
the models timed before it. KLA runs
its default backend (the fused kernels on CUDA, no host synchronisation in the layer), GLA is
fla's ``chunk_gla`` when fla is installed (an optional extra; without it the torch fallback, marked
``"gla_kernel": "torch"``), attention is ``scaled_dot_product_attention``.

A step queued from Python costs host time too, and a mixer whose step launches many small kernels
(fla's GLA: its step's kernels take about 9.4 ms of the GPU at T = 2048, but 14-27 ms of the clock,
H100, 2026-12-05) is then timed by the host, not the GPU. ``--cuda-graph`` captures each model's
whole step (zero_grad, forward, loss, backward, the fused AdamW with ``capturable=True``) once in a
CUDA graph after the warm-up and times its replays: the step as the GPU runs it, with no host
overhead, the fair comparison of the kernels; rows carry ``"cuda_graph": true``.

fla autotunes every kernel on first use (minutes per shape); with ``KALMANSCAN_FLA_FIRST_CONFIG=1``
each fla kernel takes the first of its autotuning configs (seconds; values do not depend on the
config), e.g. ``KALMANSCAN_FLA_FIRST_CONFIG=1 python -m benchmarks run model --out model.json``.
The switch (:mod:`benchmarks.fla_first`) applies while fla is imported, so the numbers for
GLA are those of an untuned first config (a lower bound on its speed).

Variants of the KLA model give A/Bs of the scan in one process: ``kla_y_var``, every layer's
scan also computing the output variance ``y_var`` and dropping it (as before the layer left it out
when not returned); ``kla_even``, the kernels without their bounds masks where the blocks are full
(``KLAConfig.even``, off by default); ``kla@field=value+field=value``, the scan launched with those
``KLAConfig`` fields changed (``kla@bwd_per_sm=16+unroll=2``; values as
:func:`benchmarks.common.overrides` reads them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import platform
import statistics
import time

import torch

from benchmarks.common import commit, launched_with, overrides, save, shape_list
from benchmarks.fla_first import import_fla
from kalmanscan.nn import SequenceModel
from kalmanscan.nn import layer as kla_layer
from kalmanscan.ops.kla.triton.library import KLAConfig

SHAPES = [(8, 2048), (2, 8192)]          # (batch, T): 16384 tokens per step
QUICK_SHAPES = [(2, 32), (1, 64)]
MIXERS = ("kla", "gla", "attention")


def build(mixer: str, d_model: int, n_layers: int, vocab: int, device: str, mlp_multiple_of: int = 64) -> SequenceModel:
    """The model every mixer shares (``SequenceModel``'s defaults); fla's kernel for GLA where installed."""
    options = dict(n_heads=4) if mixer in ("gla", "attention") else {}
    return SequenceModel(vocab, d_model, n_layers, mixer=mixer, mlp_multiple_of=mlp_multiple_of,
                         **options).to(device)


def variant_changes(mixer: str) -> dict:
    """The ``KLAConfig`` fields a mixer or KLA variant changes in the scan's launch (``{}`` for the
    plain mixers and ``kla_y_var``); ``ValueError`` naming it if it is neither a mixer nor a variant,
    so that a misspelt variant is not timed as the default."""
    if mixer in (*MIXERS, "kla_y_var"):
        return {}
    if mixer == "kla_even":
        return dict(even=True)
    known = {f.name for f in dataclasses.fields(KLAConfig)}
    try:
        changes = overrides(mixer.partition("@")[2].replace("+", ",")) if mixer.startswith("kla@") else {}
    except ValueError:
        changes = {}
    if not changes or not set(changes) <= known:
        raise ValueError(f"mixer {mixer!r} is none of {MIXERS}, kla_y_var, kla_even or kla@field=value+... "
                         f"with fields of KLAConfig")
    return changes


@contextlib.contextmanager
def scan_variant(mixer: str):
    """Inside, every KLA layer's scan runs as the variant says: ``kla_y_var`` also computes ``y_var``
    whether or not the layer returns it (as before the layer left it out); ``kla_even`` drops the
    kernels' bounds masks where the blocks are full (``KLAConfig.even``); ``kla@a=1+b=2`` launches
    with those fields changed. Other mixers run as they are."""
    original = kla_layer.kla_scan_unchecked

    def with_variance(*args, **kwargs):
        return original(*args, **{**kwargs, "variance": True})

    if mixer == "kla_y_var":
        kla_layer.kla_scan_unchecked = with_variance
    try:
        with launched_with(**variant_changes(mixer)):
            yield
    finally:
        kla_layer.kla_scan_unchecked = original


def gla_kernel(model: SequenceModel, device: str) -> str:
    """``"fla"`` when the GLA layers will run fla's ``chunk_gla``, else ``"torch"``."""
    fla = importlib.util.find_spec("fla") is not None and device == "cuda"
    uses = all(getattr(b.mixer, "use_fla", False) for b in model.blocks)
    return "fla" if fla and uses else "torch"


def training_step(model, optimizer, tokens, device):
    """One training step, not synchronised: forward under bf16 autocast, loss, backward, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    return loss


def time_steps(step, device, steps, groups, warmup):
    """Median milliseconds per step over ``groups`` of ``steps`` steps, synchronised around each
    group (steps queue back to back inside it, as in training)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times), times


def graphed(step, warmup):
    """``step`` captured once in a CUDA graph after ``warmup`` runs on a side stream (kernels
    compiled, gradients and optimizer state allocated), and a function that replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 2)):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    return lambda: (graph.replay(), loss)[1]


def bench(mixer, batch, T, args, device):
    torch.manual_seed(0)
    model = build("kla" if mixer.startswith("kla") else mixer, args.d_model, args.layers, args.vocab, device,
                  args.mlp_multiple_of)
    params = sum(p.numel() for p in model.parameters())
    torch._dynamo.reset()   # each model compiled afresh: no recompilation, no shapes marked dynamic by earlier ones
    run = torch.compile(model) if args.compile else model
    graph = args.cuda_graph and device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda", capturable=graph)
    tokens = torch.randint(0, args.vocab, (batch, T + 1), device=device)
    row = dict(mixer=mixer, batch=batch, T=T, params=params, compiled=args.compile,
               mlp_multiple_of=args.mlp_multiple_of, cuda_graph=graph)
    if mixer == "gla":
        row["gla_kernel"] = gla_kernel(model, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with scan_variant(mixer):
        try:
            step = lambda: training_step(run, optimizer, tokens, device)  # noqa: E731
            if graph:
                step = graphed(step, args.warmup)
            ms, times = time_steps(step, device, args.steps, args.groups, args.warmup)
        except torch.OutOfMemoryError as err:
            return {**row, "error": f"out of memory: {err}"}
        row.update(step_ms=ms, group_ms=times, tokens_per_s=batch * T / ms * 1e3, loss=step().item())
    if device == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run model``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--mixers", default=",".join(MIXERS))
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed group")
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile every model")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time replays of each model's whole step captured in a CUDA graph (no host overhead)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, a few steps")
    ap.add_argument("--mlp-multiple-of", type=int, default=64,
                    help="SwiGLU hidden width rounded up to a multiple (64, SequenceModel's default; 1 unrounded)")
    ap.add_argument("--shapes", default=None, help="batch x T pairs, e.g. 2x8192 (default: 8x2048,2x8192)")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    import_fla()  # first configs under KALMANSCAN_FLA_FIRST_CONFIG=1, before the GLA mixer imports fla
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    shapes = SHAPES if args.shapes is None else shape_list(args.shapes)
    if args.quick:
        args.d_model, args.layers, args.vocab, args.steps, args.groups, args.warmup = 32, 2, 64, 1, 2, 1
        shapes = QUICK_SHAPES
    result = dict(commit=commit(), device=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                  torch=torch.__version__, fla=importlib.util.find_spec("fla") is not None,
                  fla_first_config=os.environ.get("KALMANSCAN_FLA_FIRST_CONFIG") == "1",
                  d_model=args.d_model, layers=args.layers, vocab=args.vocab, rows=[])
    for mixer in args.mixers.split(","):
        variant_changes(mixer)      # a misspelt variant fails here, not after the models before it
    for batch, T in shapes:
        for mixer in args.mixers.split(","):
            row = bench(mixer, batch, T, args, device)
            result["rows"].append(row)
            speed = (f"{row['tokens_per_s'] / 1e3:8.1f}k tokens/s, {row['step_ms']:8.2f} ms/step "
                     f"(groups {min(row['group_ms']):.2f}-{max(row['group_ms']):.2f})") \
                if "tokens_per_s" in row else row["error"]
            mode = " graph" if row["cuda_graph"] else ""
            print(f"T={T:5d} B={batch} {mixer:10s}{mode} {row['params'] / 1e6:6.2f}M params  {speed}", flush=True)
    save(args.out, result)


if __name__ == "__main__":
    main()
