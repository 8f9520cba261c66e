"""The one training entry point for every task and mixer.

    python -m evidence.train --task a5 --mixer kla --layers 2 --len 64 --d-model 128 \
        --steps 5000 --lr 1e-3 --seed 0 --out benchmarks/results/a5_kla.json

Model: :class:`kalmanscan.nn.SequenceModel` (``--mixer`` one name, or a comma list per layer);
``--mixer-opt key=value`` passes a keyword to the mixers that take it (e.g.
``discretization=zoh``, or ``init=authors``: the KLA authors' initialisation scheme,
:mod:`kalmanscan.nn.init`); ``--weight-init normal`` draws every Linear and embedding weight of
the model from N(0, 0.02^2) (``SequenceModel(weight_init=...)``; with ``--mixer-opt
init=authors`` it is the authors' whole recipe); ``--noise-zero`` fixes the KLA process noise at
0 (sigma = 0, frozen): the gated-linear-attention limit of KLA. The compression task wraps the
model in the MAD autoencoder head.

The comparison of the two initialisations (MQAR T=512, 64 pairs; one seed per command):

    python -m evidence.train --task mqar --len 512 --kv-pairs 64 --vocab 256 --mixer kla \
        --layers 2 --d-model 128 --steps 20000 --lr 1e-3 --seed 1 \
        [--mixer-opt init=authors --weight-init normal]

Training: AdamW (weight decay on matrices only; never on 1-D parameters or the log-parameterised
SSM/OU rates), linear warm-up then cosine decay to zero over ``--steps`` or ``--time-limit``,
whichever comes first (see :func:`schedule_progress`; ``--steps`` defaults to 2000, and to no
step limit when ``--time-limit`` is given), bf16 autocast on CUDA (the KLA scan itself runs in
float32), gradient clipping at 1. Validation every ``--eval-every`` steps on the task's disjoint
test split; training stops early once validation token accuracy reaches the task's threshold,
after ``--time-limit`` seconds, or on a non-finite loss or gradient (before the step that would
spoil the weights). ``--lrs 1e-4,1e-3`` runs a learning-rate sweep (same seed) and reports the
best. ``--compile`` trains through ``torch.compile(model)`` (the same parameters and
checkpoints; Inductor fuses the elementwise work around the mixers' kernels).

Pause and resume (one learning rate; not with ``--time-limit``, so the schedule is by steps only):

    python -m evidence.train --task a5 ... --steps 40000 --checkpoint ck/a5.pt --stop-after 500

``--stop-after SECONDS`` is a wall-clock guard for this process that leaves the schedule alone:
once reached (checked after every step), the run saves ``--checkpoint`` and writes its JSON with
``"stopped": "paused"`` and the steps run so far. Run the same command again and it resumes from
the checkpoint: weights, optimizer, step, best and history, wall time, random states, and the
training stream's position (its generator state, :class:`evidence.tasks.base.TrainBatches`), so
it trains on exactly the batches an uninterrupted run would have. At the end (steps, threshold,
non-finite) the checkpoint is kept, marked finished, with the run's record and final weights (no
optimizer): running the command once more rewrites the same JSON without training. A checkpoint
holds the arguments that shape the run (all but ``--checkpoint``, ``--stop-after``, ``--out``,
``--device``, ``--no-progress``); resuming with another value of any of them raises a
``ValueError`` naming it.

Output: one JSON with the config, seed, commit, device, and per learning rate the best
validation token accuracy with the sequence, mean per-sequence and macro accuracies at that
evaluation, the steps run, why training stopped, a history of (step, loss, accuracy), the
gradient's 2-norm before clipping at each evaluation (``grad_norms``: [step, norm of the whole
model]; ``mixer_grad_norms``: [step, norm of layer 0's mixer, layer 1's, ...]: a mixer whose
gradient is zero shows as zero there however the rest of the model trains), and for models with KLA
layers the calibration checks of :mod:`evidence.calibration` on the final model
(its output variance against its errors, and the toolkit's diagnostics of its last KLA layer's
filters).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import commit
from benchmarks.fla_first import import_fla
from kalmanscan.nn.init import WEIGHT_INIT_DEFAULT, WEIGHT_INITS, normal_init_

from .calibration import autocast, variance_calibration
from .checkpoint import load_checkpoint, restore, run_identity, save_checkpoint, should_pause, training_state
from .tasks import IGNORE, TASKS, Scores, make_task, validation_set, train_batches
from .tasks.mad import AutoencoderModel

DEFAULT_STEPS = 2000      # --steps when neither it nor --time-limit is given


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evidence.train", description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--len", type=int, default=None, help="sequence length (task default if omitted)")
    p.add_argument("--kv-pairs", type=int, default=None, help="MQAR key-value pairs")
    p.add_argument("--vocab", type=int, default=None, help="MQAR / MAD vocabulary size")
    p.add_argument("--filler", choices=("random", "zero"), default=None,
                   help="MQAR tokens between the queries: zero (Zoology's paper configurations) or "
                        "random (the generator default)")
    p.add_argument("--mixer", default="kla", help="mixer name, or comma list of one per layer")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--expand", type=float, default=2)
    p.add_argument("--mixer-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword for the mixers that take it (value parsed as a Python literal)")
    # default None, not "torch": checkpoints written before this flag existed still resume
    p.add_argument("--weight-init", choices=WEIGHT_INITS, default=None,
                   help="model-level initialisation: normal (N(0, 0.02^2) for every Linear and embedding "
                        "weight; the default) or torch (each module's own)")
    # default None (read as 1, the unrounded width every recorded run used): old checkpoints still resume
    p.add_argument("--mlp-multiple-of", type=int, default=None,
                   help="SwiGLU hidden width rounded up to a multiple (default 1 here, unrounded, as every "
                        "recorded run; SequenceModel's own default is 64)")
    p.add_argument("--noise-zero", action="store_true", help="KLA with process noise fixed at 0")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default 2000; with --time-limit, no step limit)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lrs", default=None, help="comma list: a learning-rate sweep (overrides --lr)")
    p.add_argument("--wd", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--warmup", type=float, default=0.1, help="warm-up fraction of the schedule, in [0, 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-size", type=int, default=None, help="validation rows (task default if omitted)")
    p.add_argument("--train-size", type=int, default=None,
                   help="fixed training pool (MAD: its baseline size if omitted; others: fresh batches)")
    p.add_argument("--threshold", type=float, default=None, help="early-stop accuracy (task default)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per learning rate")
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="save the run here when paused, resume from it if it exists (one rate)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="with --checkpoint: pause after this many seconds of this process")
    p.add_argument("--stop-after-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-amp", action="store_true", help="train in float32 on CUDA too")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model for the training steps (evaluation stays eager); a "
                        "run may be resumed with or without it")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/<name>.json)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "d_state", "steps", "batch", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.steps is None and args.time_limit is None:
        args.steps = DEFAULT_STEPS
    if not 0.0 <= args.warmup < 1.0:
        raise ValueError(f"--warmup must lie in [0, 1), got {args.warmup}")
    if args.checkpoint:
        if args.time_limit is not None:
            raise ValueError("--time-limit shapes the schedule; --checkpoint schedules by steps only")
        if len(learning_rates(args)) != 1:
            raise ValueError(f"--checkpoint needs a single learning rate, got --lrs {args.lrs}")
    elif args.stop_after is not None or args.stop_after_steps is not None:
        raise ValueError("--stop-after needs --checkpoint")
    return args


def learning_rates(args) -> list:
    """The rates of ``--lrs``, else ``[--lr]``."""
    return [float(v) for v in args.lrs.split(",")] if args.lrs else [args.lr]


def mixer_options(pairs) -> dict:
    """``["key=value", ...]`` -> dict, values as Python literals where they parse, else strings."""
    opts = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--mixer-opt must be KEY=VALUE, got {pair!r}")
        try:
            opts[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            opts[key] = value
    return opts


def task_from_args(args):
    options = {}
    if args.kv_pairs is not None:
        options["num_kv_pairs"] = args.kv_pairs
    if args.vocab is not None:
        options["vocab_size"] = args.vocab
    if args.filler is not None:
        if args.task != "mqar":
            raise ValueError("--filler is for the mqar task")
        options["filler"] = args.filler
    if args.eval_size is not None:
        options["num_test"] = args.eval_size
    task = make_task(args.task, args.len, **options)
    if args.train_size is not None:
        task = dataclasses.replace(task, num_train=args.train_size)
    return task


def zero_kla_noise(model: torch.nn.Module) -> int:
    """Fix the process noise of every KLA layer at 0 (``sigma = 0``, not trained); returns the count.

    ``noise = sigma^2 dt phi(2 theta dt)`` is then exactly 0, whatever ``theta`` and ``dt``.
    """
    from kalmanscan.nn import KLA

    count = 0
    for module in model.modules():
        if isinstance(module, KLA):
            noise = module.noise_parameter()       # log sigma, or log sigma^2 for init="authors"
            with torch.no_grad():
                noise.fill_(-math.inf)
            noise.requires_grad_(False)
            module.noise_free = True
            count += 1
    return count


def build_model(task, args) -> torch.nn.Module:
    """The model of ``args`` for ``task`` (an autoencoder around it for ``head == "autoencoder"``)."""
    from kalmanscan.nn import SequenceModel

    mixer = args.mixer.split(",") if "," in args.mixer else args.mixer
    expand = int(args.expand) if float(args.expand).is_integer() else args.expand
    weight_init = getattr(args, "weight_init", None) or WEIGHT_INIT_DEFAULT
    model = SequenceModel(task.vocab_size, args.d_model, args.layers, mixer=mixer, d_state=args.d_state,
                          expand=expand, weight_init=weight_init,
                          mlp_multiple_of=getattr(args, "mlp_multiple_of", None) or 1, **mixer_options(args.mixer_opt))
    if args.noise_zero and zero_kla_noise(model) == 0:
        raise ValueError("--noise-zero needs at least one kla layer")
    if task.head == "autoencoder":
        model = AutoencoderModel(model, task.seq_len, task.vocab_size)
        if weight_init == "normal":
            normal_init_(model)                 # the autoencoder head's Linears too
    return model


def param_groups(model: torch.nn.Module, weight_decay: float):
    """Decay only trainable matrices; skip 1-D parameters, ``log_*`` rates and flagged ones."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or getattr(p, "_no_weight_decay", False) or name.rsplit(".", 1)[-1].startswith("log_")
        (plain if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction of ``progress`` in [0, 1], then cosine
    decay to 0 at ``progress = 1``."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / (1.0 - warmup)))


def schedule_progress(step: int, steps: int, elapsed: float, time_limit: float | None) -> float:
    """How far the schedule has run: the larger of the step fraction and the time fraction, so a
    run capped by ``--time-limit`` still warms up and decays fully within its time."""
    by_time = elapsed / time_limit if time_limit else 0.0
    return max(step / steps, by_time)


@torch.no_grad()
def evaluate(model, x_test, y_test, batch: int, device, amp: bool, num_classes: int) -> dict:
    """Accuracies (see :class:`evidence.tasks.Scores`) of argmax predictions on the test set."""
    model.eval()
    scores = Scores(num_classes)
    for start in range(0, x_test.shape[0], batch):
        x = torch.from_numpy(x_test[start : start + batch]).to(device)
        y = torch.from_numpy(y_test[start : start + batch]).to(device)
        with autocast(device, amp):
            logits = model(x)
        scores.update(logits.argmax(-1), y)
    model.train()
    return scores.result()


def mixer_modules(model: torch.nn.Module) -> list:
    """Each layer's sequence mixer (the ``mixer`` of every :class:`kalmanscan.nn.model.Block`), in order."""
    from kalmanscan.nn.model import Block

    return [m.mixer for m in model.modules() if isinstance(m, Block)]


def grad_norms_of(modules) -> list:
    """The 2-norm of each module's current gradient, as 0-d tensors on the gradients' device (read
    them with ``.item()`` when needed: no synchronisation here); 0 for a module without gradients."""
    return [torch.nn.utils.get_total_norm([p.grad for p in m.parameters() if p.grad is not None])
            for m in modules]


def significant(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits (gradient norms span many decades)."""
    return float(f"{x:.{digits}g}")


def train_one(task, args, lr: float, device: torch.device, test_data, deadline=None) -> dict:
    """Train one model at learning rate ``lr``; returns the run's record (see the module doc).

    With ``args.checkpoint``: resumes from it if it exists (a finished one returns its record),
    pauses at ``deadline`` (a ``time.perf_counter`` value) and saves (see the module doc).
    """
    saved = load_checkpoint(args.checkpoint, args, lr) if args.checkpoint else None
    if saved is not None and saved["finished"]:
        return saved["record"]
    torch.manual_seed(args.seed)
    model = build_model(task, args).to(device)
    forward = torch.compile(model) if args.compile else model  # shares the parameters: checkpoints unchanged
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=lr, betas=(0.9, 0.98))
    threshold = task.threshold if args.threshold is None else args.threshold
    amp = not args.no_amp
    batches = train_batches(task, args.seed, args.batch)
    mixers = mixer_modules(model)
    done = {"step": 0, "best": {"token_acc": -1.0}, "history": [], "loss": float("nan"), "wall_s": 0.0,
            "grad_norms": [], "mixer_grad_norms": []}
    if saved is not None:
        done = restore(saved, model, opt, batches, device)
    best, history, loss_val = done["best"], done["history"], done["loss"]
    grad_norms, mixer_grad_norms = done["grad_norms"], done["mixer_grad_norms"]
    stop, step = "steps", done["step"]
    start = time.perf_counter()
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=step, desc=f"{task.name} {args.mixer} lr={lr:g}", leave=False)
    last = args.steps or sys.maxsize        # no --steps with --time-limit: the time bounds the run
    for step in range(done["step"] + 1, last + 1):
        x_np, y_np = next(batches)
        x, y = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)
        with autocast(device, amp):
            logits = forward(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        out_of_time = args.time_limit is not None and time.perf_counter() - start > args.time_limit
        evaluating = step % args.eval_every == 0 or step == last or out_of_time
        layer_norms = grad_norms_of(mixers) if evaluating else None     # before clipping; read below
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(grad_norm):  # a non-finite loss gives a non-finite gradient too
            stop, loss_val = "nonfinite", loss.item()
            break
        progress = schedule_progress(step, last, time.perf_counter() - start, args.time_limit)
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(progress, args.warmup)
        opt.step()
        if bar is not None:
            bar.update(1)
        if evaluating:
            loss_val = loss.item()
            metrics = evaluate(model, *test_data, args.batch, device, amp, task.vocab_size)
            history.append([step, round(loss_val, 5), round(metrics["token_acc"], 5)])
            grad_norms.append([step, significant(grad_norm.item())])
            mixer_grad_norms.append([step, *(significant(n.item()) for n in layer_norms)])
            if metrics["token_acc"] > best["token_acc"]:
                best = {**metrics, "step": step}
            if bar is not None:
                bar.set_postfix(loss=f"{loss_val:.3f}", acc=f"{metrics['token_acc']:.3f}")
            if metrics["token_acc"] >= threshold:
                stop = "threshold"
                break
            if out_of_time:
                stop = "time"
                break
        if step < last and should_pause(args, step - done["step"], deadline):
            stop = "paused"
            break
    if bar is not None:
        bar.close()
    wall_s = done["wall_s"] + time.perf_counter() - start
    record = {
        "lr": lr,
        "best": best if best["token_acc"] >= 0 else None,
        "solved": best["token_acc"] >= threshold,
        "steps_run": step,
        "stopped": stop,
        "final_loss": loss_val,
        "wall_s": round(wall_s, 2),
        "n_params": sum(p.numel() for p in model.parameters()),
        "history": history,
        "grad_norms": grad_norms,
        "mixer_grad_norms": mixer_grad_norms,
        "calibration": variance_calibration(model, *test_data, args.batch, device, amp)
        if task.head == "lm" and stop not in ("nonfinite", "paused") else None,
    }
    if args.checkpoint:
        done = {"step": step, "best": best, "history": history, "loss": loss_val, "wall_s": wall_s,
                "grad_norms": grad_norms, "mixer_grad_norms": mixer_grad_norms}
        rest = training_state(opt, batches, device, done) if stop == "paused" else {"record": record}
        save_checkpoint(args.checkpoint, {"args": run_identity(args, lr), "finished": stop != "paused",
                                          "model": model.state_dict(), **rest})
    return record


def pick_device(name: str) -> torch.device:
    """``--device``: ``"auto"`` is CUDA where there is one, else the CPU; any other name as given."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_label(args) -> str:
    mixer = args.mixer.replace(",", "-") + ("-noise0" if args.noise_zero else "")
    extra = "".join(f"_{o.replace('=', '-')}" for o in args.mixer_opt)
    extra += f"_w-{args.weight_init}" if args.weight_init not in (None, "torch") else ""
    length = f"_L{args.len}" if args.len else ""
    return f"{args.task}{length}_{mixer}{extra}_n{args.layers}_d{args.d_model}_s{args.seed}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    import_fla()  # first configs under KALMANSCAN_FLA_FIRST_CONFIG=1, before the GLA mixer imports fla
    deadline = None if args.stop_after is None else time.perf_counter() + args.stop_after
    device = pick_device(args.device)
    task = task_from_args(args)
    test_data = validation_set(task, args.seed)
    runs = [train_one(task, args, lr, device, test_data, deadline) for lr in learning_rates(args)]
    scored = [r for r in runs if r["best"] is not None]
    best = max(scored, key=lambda r: r["best"]["token_acc"]) if scored else None
    result = {
        "label": run_label(args),
        "task": task.name,
        "seq_len": task.seq_len,
        "vocab_size": task.vocab_size,
        "mixer": args.mixer,
        "noise_zero": args.noise_zero,
        "mixer_opts": mixer_options(args.mixer_opt),
        "weight_init": args.weight_init or WEIGHT_INIT_DEFAULT,
        "layers": args.layers,
        "d_model": args.d_model,
        "seed": args.seed,
        "threshold": task.threshold if args.threshold is None else args.threshold,
        "config": vars(args),
        "commit": commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "best_lr": best["lr"] if best else None,
        "best_token_acc": best["best"]["token_acc"] if best else None,
        "best_seq_acc": best["best"]["seq_acc"] if best else None,
        "solved": any(r["solved"] for r in runs),
        "runs": runs,
    }
    out = args.out or os.path.join("benchmarks", "results", result["label"] + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1, default=float)
    acc = result["best_token_acc"]
    paused = [f"paused at step {r['steps_run']}, " for r in runs if r["stopped"] == "paused"]
    print(f"{result['label']}: {''.join(paused)}best token acc {acc if acc is None else round(acc, 4)} "
          f"(lr {result['best_lr']}), solved={result['solved']} -> {out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
