"""Byte-level language models on the Python standard library: training, throughput, the protocol.

    python -m evidence.lm train --model kla_hybrid --seed 0 --tokens 100e6 --lr 1e-3 \
        --out benchmarks/results/text/text_kla_hybrid_s0.json --checkpoint ck/text_kla_hybrid_s0.pt \
        --stop-after 540
    python -m evidence.lm throughput --models attention,kla,gla,kla_hybrid,gla_hybrid --steps 20
    python -m evidence.lm protocol --out-dir benchmarks/results/text --checkpoint-dir ck/text \
        --stop-after 540 --parallel 4 [--sweep] [--dry-run]

Data: :mod:`evidence.tasks.text` (train windows by ``(seed, step)``, fixed held-out windows).
Models: :mod:`evidence.lm_models` (about 20M parameters each, within 5% of one another).
Training: ``steps = tokens // (batch * seq_len)``; AdamW (betas 0.9, 0.95; ``--wd`` on matrices
only, ``evidence.train.param_groups``), linear warm-up over ``--warmup`` of the steps then cosine
decay to 0 (``evidence.train.lr_factor``), bf16 autocast on CUDA, gradient clipping at 1.
``--tokens-fraction f`` keeps the schedule of the whole budget and stops after its first
``ceil(f * steps)`` steps: the rate sweep compares rates on the start of the real schedule.
No host synchronisation between evaluations: the loss and gradient norm are summed on the device
and read once per ``--eval-every`` steps, when the held-out bits per byte are measured on a fixed
subset (``--eval-bytes``). Training seconds exclude evaluation.

Pause and resume as :mod:`evidence.train` (:mod:`evidence.checkpoint`): ``--checkpoint PATH
--stop-after SECONDS`` saves weights, optimizer, step, history, random states and times and
writes the JSON with ``"stopped": "paused"``; the same command resumes, and a finished run
answers with its record at once.

Output JSON: config, corpus (:func:`evidence.tasks.text.corpus_info`), ``n_params``, the layers'
mixers, ``history`` rows ``[step, tokens, train_s, train_bpb, grad_norm, heldout_bpb]`` (train
bits per byte and gradient norm averaged since the previous row), ``tokens_per_s`` (training
tokens over training seconds), ``final_bpb`` over the whole held-out split, generated
``samples`` (greedy, and temperature 0.8 with top-k 40, from fixed held-out prompts), for models
with KLA layers ``calibration`` (:func:`evidence.calibration.variance_calibration` on
``--calib-windows`` held-out windows: does the last KLA layer's output variance rank the bytes the
model gets wrong, beside the softmax confidence), commit and device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import commit
from benchmarks.fla_first import import_fla

from .calibration import autocast, variance_calibration
from .checkpoint import load_checkpoint, restore, run_identity, save_checkpoint, should_pause, training_state
from .lm_models import LM_MODELS, build_lm, check_parity, layer_mixers, parameter_counts
from .protocols import Run, launch
from .tasks.text import TrainWindows, eval_windows, load_corpus
from .train import device_name, lr_factor, param_groups, pick_device

LN2 = math.log(2.0)
SWEEP_MODELS = ("attention", "kla_hybrid")
SWEEP_LRS = (3e-4, 1e-3, 2e-3)
SWEEP_FRACTION = 0.1
MAIN_SEEDS = {"kla": 2, "kla_hybrid": 2, "attention": 2, "gla": 1, "gla_hybrid": 1}
SAMPLE_PROMPTS = 3


def add_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=None, help="override the model's width (small tests)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-amp", action="store_true", help="train in float32 on CUDA too")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evidence.lm", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one model")
    t.add_argument("--model", required=True, choices=sorted(LM_MODELS))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tokens", type=float, default=100e6, help="training tokens (bytes) of the whole schedule")
    t.add_argument("--tokens-fraction", type=float, default=1.0,
                   help="stop after this fraction of the schedule's steps (the rate sweep: 0.1)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--wd", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    t.add_argument("--warmup", type=float, default=0.03, help="warm-up fraction of the schedule, in [0, 1)")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--eval-bytes", type=int, default=2 ** 18, help="held-out bytes of the periodic evaluation")
    t.add_argument("--calib-windows", type=int, default=64, help="held-out windows of the variance check")
    t.add_argument("--sample-bytes", type=int, default=200, help="bytes generated per sample")
    t.add_argument("--prompt-bytes", type=int, default=128)
    t.add_argument("--corpus-root", default=None, help="directory of .py files (default: the stdlib)")
    t.add_argument("--checkpoint", default=None, metavar="PATH")
    t.add_argument("--stop-after", type=float, default=None, metavar="SECONDS")
    t.add_argument("--stop-after-steps", type=int, default=None, help=argparse.SUPPRESS)
    t.add_argument("--out", required=True)
    t.add_argument("--no-progress", action="store_true", help="accepted for the launcher; nothing is printed per step")
    add_shape_args(t)
    s = sub.add_parser("throughput", help="time each model's training step alone")
    s.add_argument("--models", default=",".join(LM_MODELS))
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--warmup-steps", type=int, default=5)
    s.add_argument("--out", default=None)
    add_shape_args(s)
    r = sub.add_parser("protocol", help="the sweep or the main runs as parallel processes")
    r.add_argument("--out-dir", default=os.path.join("benchmarks", "results", "text"))
    r.add_argument("--checkpoint-dir", default=None)
    r.add_argument("--stop-after", type=float, default=None, metavar="SECONDS")
    r.add_argument("--parallel", type=int, default=4,
                   help="processes at once (a 20M model at 16 x 2048 may hold 10 GiB or more: see throughput's "
                        "peak_mem_gib)")
    r.add_argument("--sweep", action="store_true", help=f"the rate sweep ({SWEEP_FRACTION:g} of the schedule)")
    r.add_argument("--lr", type=float, default=1e-3, help="the shared rate of the main runs")
    r.add_argument("--tokens", type=float, default=100e6)
    r.add_argument("--models", default=None, help="comma list: only these models' runs")
    r.add_argument("--sweep-lrs", default=",".join(f"{lr:g}" for lr in SWEEP_LRS), help="the sweep's rates")
    r.add_argument("--extra", default="", help="more train arguments for every run, one string")
    r.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    for name in ("batch", "seq_len", "layers", "eval_every", "steps", "parallel"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.command == "train":
        if not 0.0 < args.tokens_fraction <= 1.0:
            raise ValueError(f"--tokens-fraction must lie in (0, 1], got {args.tokens_fraction}")
        if not 0.0 <= args.warmup < 1.0:
            raise ValueError(f"--warmup must lie in [0, 1), got {args.warmup}")
        if schedule_steps(args) < 1:
            raise ValueError(f"--tokens {args.tokens:g} is less than one batch of {args.batch * args.seq_len}")
        if args.checkpoint is None and (args.stop_after is not None or args.stop_after_steps is not None):
            raise ValueError("--stop-after needs --checkpoint")
    return args


def schedule_steps(args) -> int:
    """Steps of the whole schedule: ``tokens // (batch * seq_len)``."""
    return int(args.tokens) // (args.batch * args.seq_len)


def train_step(model, opt, window: np.ndarray, device, amp: bool):
    """One AdamW step on a uint8 ``(batch, seq_len + 1)`` window; ``(loss, grad_norm)`` as device
    tensors (nothing read back). The caller sets the rate first."""
    tokens = torch.from_numpy(window)
    if device.type == "cuda":
        tokens = tokens.pin_memory()              # an asynchronous copy: the host does not wait
    tokens = tokens.to(device, non_blocking=True).long()
    with autocast(device, amp):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach(), grad_norm


def make_optimizer(model, lr: float, wd: float):
    return torch.optim.AdamW(param_groups(model, wd), lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def bits_per_byte(model, x: np.ndarray, y: np.ndarray, batch: int, device, amp: bool) -> float:
    """Mean cross-entropy in bits over the targets of ``y`` that are not ``IGNORE``, one host read."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for lo in range(0, x.shape[0], batch):
        xb = torch.from_numpy(x[lo:lo + batch]).to(device)
        yb = torch.from_numpy(y[lo:lo + batch]).to(device)
        with autocast(device, amp):
            logits = model(xb)
        total += F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum").double()
        count += int((y[lo:lo + batch] >= 0).sum())
    model.train()
    return total.item() / (count * LN2)


def sample_prompts(data: np.ndarray, count: int, length: int) -> np.ndarray:
    """``count`` prompts of ``length`` bytes from evenly spaced places of ``data``, each starting
    after a newline."""
    prompts = []
    for start in np.linspace(0, data.size - 2 * length - 1, count).astype(np.int64):
        newline = np.flatnonzero(data[start:start + length] == ord("\n"))
        begin = start + (int(newline[0]) + 1 if newline.size else 0)
        prompts.append(data[begin:begin + length])
    return np.stack(prompts)


@torch.no_grad()
def samples(model, data: np.ndarray, seed: int, prompt_bytes: int, new_bytes: int, device) -> list:
    """Greedy and sampled (temperature 0.8, top-k 40) continuations of fixed held-out prompts."""
    prompts = torch.from_numpy(sample_prompts(data, SAMPLE_PROMPTS, prompt_bytes)).long().to(device)
    model.eval()
    greedy = model.generate(prompts, new_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    sampled = model.generate(prompts, new_bytes, temperature=0.8, top_k=40, generator=gen)
    model.train()

    def text(row):
        return bytes(row.tolist()).decode("utf-8", errors="replace")

    P = prompts.shape[1]
    return [{"prompt": text(p), "greedy": text(g[P:]), "sampled": text(s[P:])}
            for p, g, s in zip(prompts.cpu(), greedy.cpu(), sampled.cpu())]


def train_lm(args, deadline: float | None = None) -> dict:
    """Train ``args.model``; returns the run's record (see the module doc)."""
    saved = load_checkpoint(args.checkpoint, args, args.lr) if args.checkpoint else None
    if saved is not None and saved["finished"]:
        return saved["record"]
    device, amp = pick_device(args.device), not args.no_amp
    corpus = load_corpus(args.corpus_root)
    windows = TrainWindows(corpus.train, args.seed, args.batch, args.seq_len)
    x_eval, y_eval = eval_windows(corpus.test, args.seq_len, args.eval_bytes)
    torch.manual_seed(args.seed)
    model = build_lm(args.model, args.d_model, args.layers).to(device)
    opt = make_optimizer(model, args.lr, args.wd)
    steps = schedule_steps(args)
    last = math.ceil(steps * args.tokens_fraction)
    done = {"step": 0, "history": [], "train_s": 0.0, "wall_s": 0.0, "sums": [0.0, 0.0, 0]}
    if saved is not None:
        done = restore(saved, model, opt, windows, device)
    history, train_s = done["history"], done["train_s"]
    loss_sum = torch.tensor(done["sums"][0], dtype=torch.float64, device=device)
    norm_sum = torch.tensor(done["sums"][1], dtype=torch.float64, device=device)
    counted = done["sums"][2]
    start = segment = time.perf_counter()
    stop, step = "steps", done["step"]
    for step in range(done["step"] + 1, last + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step / steps, args.warmup)
        loss, grad_norm = train_step(model, opt, windows.at(step), device, amp)
        loss_sum += loss
        norm_sum += grad_norm
        counted += 1
        if step % args.eval_every == 0 or step == last:
            mean_loss, mean_norm = loss_sum.item() / counted, norm_sum.item() / counted   # syncs
            train_s += time.perf_counter() - segment
            bpb = bits_per_byte(model, x_eval, y_eval, args.batch, device, amp)
            history.append([step, step * args.batch * args.seq_len, round(train_s, 3),
                            round(mean_loss / LN2, 5), round(mean_norm, 5), round(bpb, 5)])
            loss_sum.zero_()
            norm_sum.zero_()
            counted = 0
            segment = time.perf_counter()
            if not (math.isfinite(mean_loss) and math.isfinite(mean_norm)):
                stop = "nonfinite"
                break
        if step < last and should_pause(args, step - done["step"], deadline):
            stop = "paused"
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if stop == "paused":
        train_s += time.perf_counter() - segment
    wall_s = done["wall_s"] + time.perf_counter() - start
    record = run_record(args, model, corpus.info, steps, step, stop, history, train_s, wall_s)
    if stop == "steps":
        x_all, y_all = eval_windows(corpus.test, args.seq_len)
        record["final_bpb"] = bits_per_byte(model, x_all, y_all, args.batch, device, amp)
        record["samples"] = samples(model, corpus.test, args.seed, args.prompt_bytes, args.sample_bytes, device)
        x_cal, y_cal = eval_windows(corpus.test, args.seq_len, args.calib_windows * args.seq_len)
        record["calibration"] = variance_calibration(model, x_cal, y_cal, args.batch, device, amp)
    if args.checkpoint:
        sums = [loss_sum.item(), norm_sum.item(), counted]
        done = {"step": step, "history": history, "train_s": train_s, "wall_s": wall_s, "sums": sums}
        plain = json.loads(json.dumps(record, default=float))      # only what weights-only loading reads
        rest = training_state(opt, windows, device, done) if stop == "paused" else {"record": plain}
        save_checkpoint(args.checkpoint, {"args": run_identity(args, args.lr), "finished": stop != "paused",
                                          "model": model.state_dict(), **rest})
    return record


def run_record(args, model, corpus_info: dict, steps: int, step: int, stop: str, history: list,
               train_s: float, wall_s: float) -> dict:
    tokens_run = step * args.batch * args.seq_len
    return {
        "model": args.model,
        "seed": args.seed,
        "lr": args.lr,
        "config": {k: v for k, v in vars(args).items() if k != "command"},
        "layers": layer_mixers(args.model, args.layers),
        "d_model": model.embedding.embedding_dim,
        "n_params": sum(p.numel() for p in model.parameters()),
        "corpus": corpus_info,
        "steps": steps,
        "steps_run": step,
        "tokens_run": tokens_run,
        "stopped": stop,
        "train_s": round(train_s, 3),
        "wall_s": round(wall_s, 3),
        "tokens_per_s": tokens_run / train_s if train_s > 0 else None,
        "history": history,
        "final_bpb": None,
        "samples": None,
        "calibration": None,
        "runs": [{"lr": args.lr, "stopped": stop, "steps_run": step}],   # evidence.protocols.launch reads it
        "commit": commit(),
        "device": device_name(pick_device(args.device)),
        "torch": str(torch.__version__),
    }


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, default=float)


def throughput(args) -> dict:
    """Each model's training step timed alone in this process (after ``--warmup-steps``): tokens/s."""
    device, amp = pick_device(args.device), not args.no_amp
    rng = np.random.default_rng(0)
    window = rng.integers(0, 256, size=(args.batch, args.seq_len + 1), dtype=np.uint8)
    out = {}
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build_lm(name, args.d_model, args.layers).to(device)
        opt = make_optimizer(model, 1e-4, 0.1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup_steps + args.steps):
            if i == args.warmup_steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                began = time.perf_counter()
            train_step(model, opt, window, device, amp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        out[name] = {"n_params": sum(p.numel() for p in model.parameters()),
                     "step_ms": 1e3 * seconds / args.steps,
                     "tokens_per_s": args.steps * args.batch * args.seq_len / seconds, "peak_mem_gib": peak}
        print(f"{name}: {out[name]['tokens_per_s']:,.0f} tokens/s, {out[name]['step_ms']:.1f} ms/step",
              file=sys.stderr)
        del model, opt
    return {"batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "models": out,
            "commit": commit(), "device": device_name(device), "torch": str(torch.__version__)}


class LMRun(Run):
    """A :class:`evidence.protocols.Run` of ``python -m evidence.lm train``."""

    def command(self, out_dir: str, python: str = sys.executable, **options) -> list:
        return [python, "-m", "evidence.lm", "train", *self.train_argv(out_dir, **options)]


def text_runs(sweep: bool, lr: float, tokens: float, extra=(), models=None, sweep_lrs=SWEEP_LRS) -> list:
    """The sweep (``sweep_lrs`` on ``SWEEP_MODELS``, the first ``SWEEP_FRACTION`` of the schedule,
    seed 0) or the main runs (``MAIN_SEEDS`` per model at ``lr``, the slow KLA models first);
    ``models``: only these."""
    unknown = sorted(set(models or ()) - set(LM_MODELS))
    if unknown:
        raise ValueError(f"models must be among {sorted(LM_MODELS)}, got {unknown}")
    common = ["--tokens", f"{tokens:g}", *extra]
    if sweep:
        cells = [(m, r) for m in SWEEP_MODELS for r in sweep_lrs if models is None or m in models]
        return [LMRun(f"text_sweep_{m}_lr{r:g}_s0",
                      ["--model", m, "--seed", "0", "--lr", f"{r:g}", "--tokens-fraction", f"{SWEEP_FRACTION:g}",
                       *common])
                for m, r in cells]
    order = [(m, s) for s in range(max(MAIN_SEEDS.values())) for m in MAIN_SEEDS
             if s < MAIN_SEEDS[m] and (models is None or m in models)]
    return [LMRun(f"text_{m}_s{s}", ["--model", m, "--seed", str(s), "--lr", f"{lr:g}", *common])
            for m, s in order]


def protocol(args) -> list:
    models = None if args.models is None else args.models.split(",")
    sweep_lrs = [float(v) for v in args.sweep_lrs.split(",")]
    runs = text_runs(args.sweep, args.lr, args.tokens, shlex.split(args.extra), models, sweep_lrs)
    if args.stop_after is not None and args.checkpoint_dir is None:
        raise ValueError("--stop-after needs --checkpoint-dir")
    resume = {"checkpoint_dir": args.checkpoint_dir, "stop_after": args.stop_after}
    for run in runs:             # every run's arguments checked before any starts
        parse_args(["train", *run.train_argv(args.out_dir, **resume)])
    if args.dry_run:
        for run in runs:
            print(shlex.join(run.command(args.out_dir, **resume)))
        return []
    return launch(runs, args.out_dir, args.parallel, **resume)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "protocol":
        return protocol(args)
    import_fla()    # first configs under KALMANSCAN_FLA_FIRST_CONFIG=1, before the GLA mixer imports fla
    if args.command == "throughput":
        result = throughput(args)
        full_size = args.d_model is None
        result["parameter_spread"] = check_parity(parameter_counts(layers=args.layers)) if full_size else None
        if args.out:
            write_json(args.out, result)
        return result
    deadline = None if args.stop_after is None else time.perf_counter() + args.stop_after
    record = train_lm(args, deadline)
    write_json(args.out, record)
    bpb = record["final_bpb"] if record["final_bpb"] is not None else (record["history"] or [[None] * 6])[-1][5]
    print(f"{args.model} s{args.seed} lr {args.lr:g}: {record['stopped']} at step {record['steps_run']}, "
          f"held-out bpb {bpb} -> {args.out}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
