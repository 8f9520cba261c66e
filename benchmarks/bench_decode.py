"""Decoding speed of the same :class:`kalmanscan.nn.SequenceModel` with the KLA, attention and GLA
mixers, in one process: the time of one decoding step replayed from a CUDA graph, its tokens per
second, its kernels and its memory, beside the prefill's tokens per second.

    python -m benchmarks run decode --json decode.json
    python -m benchmarks.bench_decode --contexts 2048,8192 --batches 16 --mixers kla,attention

Every model is d_model 512, 4 layers, SwiGLU, vocabulary 4096, in bf16. A step is
``model.step(token, state, out=state)`` and the greedy choice of the next token (what
:meth:`~kalmanscan.nn.SequenceModel.generate` replays), captured once in a CUDA graph after one eager
step and timed over its replays (the GPU's time, no host overhead): the median over groups of
replays between CUDA events. Attention decodes from a static KV cache holding ``context`` tokens
(filled with random keys and values: its step reads the whole cache whatever they are); KLA's and
GLA's states have one size at every context (GLA's step is the baseline's recurrent step in torch
operations; fla's recurrent kernel is not used). Kernels per step are counted by
``torch.profiler`` over one eager step (every device activity: kernels, copies, fills).

The hardware limit of a step is the bytes it must move over the device's copy bandwidth (a 1 GiB
device-to-device copy timed in the same run): the parameters read once, the state read and
written (KLA's variance, mean and conv window; GLA's matrix state; attention's cache read whole).
Rows give both floors: ``state_floor_ms`` (the state's bytes alone) and ``floor_ms`` (with the
parameters), and ``fraction_of_limit = floor_ms / step_ms``.

Prefill: the prompt of ``context`` tokens read by the forward in chunks (at most 2^17 tokens a
chunk over the batch), timed once after a warm-up; skipped above ``--prefill-max-tokens`` tokens
(batch x context) to bound the run's time.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import commit, copy_bandwidth, save
from kalmanscan.nn import SequenceModel
from kalmanscan.nn.baselines.attention import AttentionState

MIXERS = ("kla", "attention", "gla")
CONTEXTS = (2048, 8192, 32768, 131072)
BATCHES = (1, 16, 64)
CHUNK_TOKENS = 1 << 17     # tokens of one prefill chunk over the whole batch


def build(mixer: str, args: argparse.Namespace) -> SequenceModel:
    torch.manual_seed(0)
    model = SequenceModel(args.vocab, args.d_model, args.layers, mixer=mixer, device="cuda")
    return model.to(torch.bfloat16).eval()


def tensors(state) -> list[torch.Tensor]:
    return [x for layer in state for x in layer if isinstance(x, torch.Tensor)]


def nbytes(xs) -> int:
    return sum(x.numel() * x.element_size() for x in xs)


def decoding_state(model: SequenceModel, mixer: str, batch: int, context: int, slack: int) -> list:
    """The state of ``batch`` sequences ``context - slack`` tokens in: attention's cache of
    ``context`` positions filled with random keys and values, the recurrent states as at the start
    (their step's work does not depend on their values)."""
    state = model.init_state(batch, "cuda")
    if mixer != "attention":
        return state
    filled = []
    for layer in state:
        k = layer.k.new_empty(*layer.k.shape[:2], context, layer.k.shape[3]).normal_()
        v = torch.randn_like(k)
        length = context - slack
        filled.append(AttentionState(k, v, torch.tensor(length, device="cuda"), length))
    return filled


def count_kernels(step) -> int:
    """Device activities (kernels, copies, fills) of one call of ``step``, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int, groups: int) -> float:
    """Median over ``groups`` of the milliseconds per replay of ``reps`` replays back to back."""
    times = []
    for _ in range(groups):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def decode_row(model: SequenceModel, mixer: str, batch: int, context: int, args, bandwidth: float,
               kernels: dict) -> dict:
    slack = 2 + args.warmup + args.reps * args.groups
    state = decoding_state(model, mixer, batch, context, slack)
    current = torch.zeros(batch, dtype=torch.long, device="cuda")

    def step():
        logits, _ = model.step(current, state, out=state)
        current.copy_(logits.argmax(-1))

    with torch.no_grad():
        step()                                            # compiles, tunes and fills every cache
        if (mixer, batch) not in kernels:
            kernels[(mixer, batch)] = count_kernels(step)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(args.warmup):
            graph.replay()
        ms = replay_ms(graph, args.reps, args.groups)
    params = nbytes(model.parameters())
    state_bytes = nbytes(tensors(state))
    moved = state_bytes if mixer == "attention" else 2 * state_bytes
    state_floor = moved / bandwidth / 1e6
    floor = (moved + params) / bandwidth / 1e6
    return dict(step_ms=ms, tokens_per_s=batch / ms * 1e3, kernels_per_step=kernels[(mixer, batch)],
                state_gb=state_bytes / 1e9, peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9,
                state_floor_ms=state_floor, floor_ms=floor, fraction_of_limit=floor / ms)


def prefill_tokens_per_s(model: SequenceModel, batch: int, context: int, vocab: int) -> float:
    """Tokens per second of reading a random prompt of ``context`` tokens by the forward in chunks."""
    chunk = max(1, min(context, CHUNK_TOKENS // batch))
    tokens = torch.randint(0, vocab, (batch, context), device="cuda")

    def prefill(n):
        state = model.init_state(batch, "cuda", capacity=n)
        for lo in range(0, n, chunk):
            _, state = model(tokens[:, lo:min(lo + chunk, n)], state=state)

    with torch.no_grad():
        prefill(min(context, chunk))                      # compiles and tunes the kernels
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        prefill(context)
        end.record()
        torch.cuda.synchronize()
    return batch * context / start.elapsed_time(end) * 1e3


def bench(mixer: str, batch: int, context: int, args, bandwidth: float, kernels: dict) -> dict:
    row = dict(mixer=mixer, batch=batch, context=context)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(mixer, args)
    try:
        row.update(decode_row(model, mixer, batch, context, args, bandwidth, kernels))
    except torch.OutOfMemoryError as err:
        return {**row, "error": f"out of memory: {str(err).splitlines()[0]}"}
    torch.cuda.empty_cache()
    if batch * context <= args.prefill_max_tokens:
        try:
            row["prefill_tokens_per_s"] = prefill_tokens_per_s(model, batch, context, args.vocab)
        except torch.OutOfMemoryError as err:
            row["prefill_error"] = f"out of memory: {str(err).splitlines()[0]}"
    return row


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run decode``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, metavar="PATH", help="JSON file for the results (rows as they finish)")
    ap.add_argument("--mixers", default=",".join(MIXERS))
    ap.add_argument("--contexts", type=ints, default=list(CONTEXTS))
    ap.add_argument("--batches", type=ints, default=list(BATCHES))
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50, help="graph replays per timed group")
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="graph replays before timing")
    ap.add_argument("--prefill-max-tokens", type=int, default=1 << 21,
                    help="prefill timed only up to this many tokens (batch x context)")
    return ap


def main(argv: list[str] | None = None) -> dict | None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device (its steps are replayed from CUDA graphs); none is available, "
              "nothing measured.")
        return None
    bandwidth = copy_bandwidth()
    result = dict(commit=commit(), device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16",
                  d_model=args.d_model, layers=args.layers, vocab=args.vocab, copy_gb_per_s=bandwidth, rows=[])
    print(f"{result['device']}, copy bandwidth {bandwidth:.0f} GB/s; d_model {args.d_model}, {args.layers} layers, "
          f"bf16, steps replayed from CUDA graphs", flush=True)
    kernels: dict = {}
    for mixer in args.mixers.split(","):
        for context in args.contexts:
            for batch in args.batches:
                row = bench(mixer, batch, context, args, bandwidth, kernels)
                result["rows"].append(row)
                save(args.json, result)
                if "error" in row:
                    print(f"{mixer:9s} ctx {context:6d} B {batch:3d}  {row['error']}", flush=True)
                    continue
                prefill = row.get("prefill_tokens_per_s")
                prefill = f"{prefill / 1e6:7.2f}M tok/s" if prefill else "      (skipped)"
                print(f"{mixer:9s} ctx {context:6d} B {batch:3d}  step {row['step_ms']:7.3f} ms "
                      f"{row['tokens_per_s'] / 1e3:8.1f}k tok/s  {row['kernels_per_step']:4d} kernels  "
                      f"state {row['state_gb']:7.3f} GB  peak {row['peak_memory_gb']:6.2f} GB  "
                      f"limit {row['floor_ms']:.3f} ms ({100 * row['fraction_of_limit']:5.1f}%; state alone "
                      f"{row['state_floor_ms']:.4f} ms)  prefill {prefill}", flush=True)
    print(json.dumps(dict(rows=len(result["rows"]))))
    return result


if __name__ == "__main__":
    main()
