"""The evaluation protocols as lists of training runs, launched as parallel processes on one GPU.

    python -m evidence.protocols a5 --lengths 16 32 --depths 1 2 --steps 3000 \
        --time-limit 150 --parallel 12 --out-dir benchmarks/results/a5
    python -m evidence.protocols mqar|mad|ou ... [--dry-run]

Each protocol function returns :class:`Run` specs (a label and the ``evidence.train``
arguments); :func:`launch` runs them ``parallel`` at a time (small models leave a GPU mostly idle,
so several processes share it), one log per run, and returns the JSON results. ``--dry-run``
prints the commands instead. Protocols (issue 6, item 3), full sizes by default:

* ``a5``: A5 at lengths {16, 32, 64, 128}, depths 1-4, width 128; solved = best validation token
  accuracy > 90%; plus two controls at depth 1: Z60 (abelian, every mixer should solve it) at the
  longest length, and a GRU on A5 at every length (a nonlinear recurrence, which should solve A5:
  a length it does not learn says the budget, not the mixers, is short).
* ``mqar``: T in {512, 2048}, vocabulary 8192, kv pairs {64, 128}, d_model {64, 128}, 2 layers;
  the Zoology paper's data and optimisation settings (zero filler, rates 1e-4 .. 1e-2, 65,536
  tokens per batch, 6.4M training sequences), see :func:`mqar_protocol`.
* ``mad``: the six MAD tasks at their baseline settings, d_model 128, 2 x [mixer, SwiGLU],
  learning rates {1e-4, 5e-4, 1e-3}.
* ``ou``: KLA with the OU vs the zero-order-hold discretisation at depths 2, 4, 8 on one task.
* ``mqar_control``: the positive control of the MQAR result at T = 2048 (GLA at chance): the same
  GLA on easier settings at that length, and the failing runs re-run briefly for their gradient
  norms, see :func:`mqar_control`.

Every mixer gets the same budget and the same learning rates (``MIXER_SPECS``; ``kla_noise0`` is
KLA with the process noise fixed at 0, its gated-linear-attention limit; ``gla_conv`` is GLA with
the width-4 short convolution that KLA has, ``gla_conv_k2`` the same with keys of width d_model
(``expand_k=2``: about KLA's state at ``d_state`` 16, ``expand`` 2), ``gla_conv_k2_g256`` that
with its log decay divided by 256 instead of fla's 16 (it hears the whole of T = 2048 at
initialisation, as KLA does: :mod:`evidence.reach`), ``kla_noconv`` KLA without a conv).

A protocol longer than one sitting runs over several calls of the same command (one learning
rate per run, no ``--time-limit``):

    python -m evidence.protocols a5 --lengths 16 --steps 40000 --parallel 8 \
        --out-dir benchmarks/results/a5 --checkpoint-dir ck/a5 --stop-after 540

``--checkpoint-dir DIR`` gives each run ``--checkpoint DIR/<label>.pt``; ``--stop-after SECONDS``
is the whole launch's budget: each run starts with the seconds left as its ``--stop-after`` (it
pauses and saves then), and none starts with less than ``MIN_START_S`` left. Runs are started in
the protocol's order, so each call resumes the paused ones first; a finished run's checkpoint
answers at once with its result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

MIXER_SPECS = {
    "kla": ["--mixer", "kla"],
    "kla_noise0": ["--mixer", "kla", "--noise-zero"],
    "kla_zoh": ["--mixer", "kla", "--mixer-opt", "discretization=zoh"],
    "attention": ["--mixer", "attention"],
    "gla": ["--mixer", "gla"],
    "gla_conv": ["--mixer", "gla", "--mixer-opt", "d_conv=4"],
    "gla_conv_k2": ["--mixer", "gla", "--mixer-opt", "d_conv=4", "--mixer-opt", "expand_k=2"],
    "gla_conv_k2_g256": ["--mixer", "gla", "--mixer-opt", "d_conv=4", "--mixer-opt", "expand_k=2",
                         "--mixer-opt", "gate_normalizer=256"],
    "kla_noconv": ["--mixer", "kla", "--mixer-opt", "d_conv=1"],
    "mamba": ["--mixer", "mamba"],
    "gdn": ["--mixer", "gdn"],
    "mlstm": ["--mixer", "mlstm"],
    "gru": ["--mixer", "gru"],
}
BASELINE_MIXERS = ("kla", "kla_noise0", "attention", "gla", "gla_conv", "mamba")
MIN_START_S = 60          # with a launch budget: no run starts with less time left


@dataclass(frozen=True)
class Run:
    """One training run: ``label`` (unique within a protocol) and its ``evidence.train`` argv."""

    label: str
    argv: list

    def train_argv(self, out_dir: str, checkpoint_dir: str | None = None,
                   stop_after: float | None = None) -> list:
        """The ``evidence.train`` arguments: ``argv`` plus the output (and checkpoint) paths."""
        argv = [*self.argv, "--out", os.path.join(out_dir, self.label + ".json"), "--no-progress"]
        if checkpoint_dir is not None:
            argv += ["--checkpoint", os.path.join(checkpoint_dir, self.label + ".pt")]
        if stop_after is not None:
            argv += ["--stop-after", f"{stop_after:g}"]
        return argv

    def command(self, out_dir: str, python: str = sys.executable, **options) -> list:
        """The process to launch; ``options`` as :meth:`train_argv`'s."""
        return [python, "-m", "evidence.train", *self.train_argv(out_dir, **options)]


def _common(steps, lrs, seed, time_limit, batch):
    argv = ["--steps", str(steps), "--seed", str(seed), "--batch", str(batch)]
    argv += ["--lrs", ",".join(f"{lr:g}" for lr in lrs)]
    if time_limit is not None:
        argv += ["--time-limit", str(time_limit)]
    return argv


def _spec(mixer: str) -> list:
    if mixer not in MIXER_SPECS:
        raise ValueError(f"mixer must be one of {sorted(MIXER_SPECS)}, got {mixer!r}")
    return MIXER_SPECS[mixer]


def a5_min_depth(lengths=(16, 32, 64, 128), depths=(1, 2, 3, 4), mixers=BASELINE_MIXERS,
                 width=128, steps=20000, lrs=(1e-3,), seed=0, time_limit=None, batch=128,
                 control="z60", recurrent_control="gru") -> list:
    """A5 at every (length, depth, mixer), plus ``control`` (a task) for every mixer at depth 1 and
    the longest length, and A5 with ``recurrent_control`` (a mixer) at depth 1 at every length
    where it is not among ``mixers``."""
    common = _common(steps, lrs, seed, time_limit, batch)
    cells = [(m, n, d) for m in mixers for n in lengths for d in depths]
    if recurrent_control and recurrent_control not in mixers:
        cells += [(recurrent_control, n, 1) for n in lengths]
    runs = []
    for mixer, length, depth in cells:
        argv = ["--task", "a5", "--len", str(length), "--layers", str(depth),
                "--d-model", str(width), *_spec(mixer), *common]
        runs.append(Run(f"a5_L{length}_n{depth}_{mixer}_s{seed}", argv))
    if control:
        length = max(lengths)
        for mixer in mixers:
            argv = ["--task", control, "--len", str(length), "--layers", "1",
                    "--d-model", str(width), *_spec(mixer), *common]
            runs.append(Run(f"{control}_L{length}_n1_{mixer}_s{seed}", argv))
    return runs


ZOOLOGY_LRS = (1e-4, 4.6e-4, 2.2e-3, 1e-2)   # np.logspace(-4, -2, 4), Zoology's sweep
ZOOLOGY_TOKENS_PER_BATCH = 65536              # Zoology's batch: 128 at T = 512, 256 at T = 256, ...
ZOOLOGY_SEQUENCES = 64 * 100_000              # 64 epochs of 100,000 training sequences


def zoology_batch(seq_len: int) -> int:
    """Zoology's MQAR batch size at ``seq_len`` (65,536 tokens, at most 512 sequences)."""
    return max(1, min(512, ZOOLOGY_TOKENS_PER_BATCH // seq_len))


def mqar_protocol(lengths=(512, 2048), kv_pairs=(64, 128), widths=(64, 128),
                  mixers=BASELINE_MIXERS, vocab=8192, layers=2, steps=None, lrs=ZOOLOGY_LRS, seed=0,
                  time_limit=None, batch=None, filler="zero") -> list:
    """MQAR accuracy against state size: every (T, kv pairs, d_model, mixer), ``layers`` deep.

    Defaults follow the Zoology paper's MQAR configurations: zero filler between the queries,
    the learning-rate sweep 1e-4 .. 1e-2, a batch of 65,536 tokens (128 sequences at T = 512) and
    64 epochs of 100,000 sequences (``steps=None``: 6.4M sequences / batch, 50,000 steps at
    T = 512). ``batch`` or ``steps`` given override that for every length.
    """
    runs = []
    for mixer, T, kv, d in [(m, t, k, d) for m in mixers for t in lengths for k in kv_pairs
                            for d in widths]:
        b = zoology_batch(T) if batch is None else batch
        n = max(1, ZOOLOGY_SEQUENCES // b) if steps is None else steps
        argv = [*_mqar_task_args(T, kv, vocab, filler, layers, d), *_spec(mixer),
                *_common(n, lrs, seed, time_limit, b)]
        v = "" if vocab == 8192 else f"_v{vocab}"
        runs.append(Run(f"mqar_T{T}_kv{kv}{v}_d{d}_{mixer}_s{seed}", argv))
    return runs


def _mqar_task_args(length, kv, vocab, filler, layers, width) -> list:
    return ["--task", "mqar", "--len", str(length), "--kv-pairs", str(kv), "--vocab", str(vocab),
            "--filler", filler, "--layers", str(layers), "--d-model", str(width)]


# GLA's recorded MQAR runs at T = 2048 (2 layers, zero filler), at chance for 30,000 steps in both seeds
MQAR_FAILING = {"length": 2048, "kv": 64, "vocab": 256, "width": 128, "batch": 32, "lr": 1e-3, "seeds": (1, 2)}


def mqar_control(kv_pairs=(8, 16), widths=(128, 256), mixers=("gla_conv_k2",), steps=3000,
                 failing_steps=2000, reference="kla", lrs=(1e-3,), seed=1, batch=32, vocab=256) -> list:
    """Is GLA's flat loss on MQAR at T = 2048 the layer's, or a broken training path?

    The recorded runs (``MQAR_FAILING``: 64 pairs, vocabulary 256, d_model 128, 2 layers, batch 32,
    rate 1e-3, zero filler; GLA with KLA's width-4 conv and ``expand_k=2``) kept the loss at
    ln 128 = 4.852, the loss of a model that ignores the context, from step 500 to 30,000 in both
    seeds. Three kinds of run answer the question, all at T = 2048 with the zero filler:

    * controls: each of ``mixers`` on easier settings, every (``kv_pairs``, ``widths``) pair (fewer
      pairs; d_model 256 quadruples GLA's state, ``D^2 / 2`` floats a layer at ``expand_k=2``),
      ``steps`` steps, seed ``seed``. Accuracy rising above ``1 / kv`` (what a model that knows only
      which values the context holds reaches; chance is 1/128) shows the path teaches GLA there;
    * the failing configuration itself, seeds 1 and 2, on a ``failing_steps``-step schedule (the
      flat line began by step 500 on schedules of 5,000 and 30,000 steps alike): its record carries
      the gradient norms, of the whole model and of each layer's mixer, at every evaluation
      (:mod:`evidence.train`), finite and non-zero if the gradient reaches the layer;
    * ``reference`` (a mixer that solved it, ``None`` for none) in the failing configuration, seed 1,
      the same schedule: the size of a live mixer's gradient on the same plateau (KLA's loss stayed
      near ln 128 until about step 1,000 in both recorded seeds).

    Sizing: the recorded runs took 0.071 s a step (GLA; KLA 0.058) as four processes sharing an
    H200; the seven default runs sharing one GPU (``--parallel 7``) at about 0.1 s a step fit in
    about six minutes.
    """
    f = MQAR_FAILING
    failing_args = _mqar_task_args(f["length"], f["kv"], f["vocab"], "zero", 2, f["width"])
    failing_label = f"T{f['length']}_kv{f['kv']}_v{f['vocab']}_d{f['width']}"
    runs = []
    for mixer in mixers:
        for kv, width in [(kv, width) for kv in kv_pairs for width in widths]:
            argv = [*_mqar_task_args(f["length"], kv, vocab, "zero", 2, width), *_spec(mixer),
                    *_common(steps, lrs, seed, None, batch)]
            runs.append(Run(f"mqar_control_T{f['length']}_kv{kv}_v{vocab}_d{width}_{mixer}_s{seed}", argv))
    failing = [("failing", mixer, s) for mixer in mixers for s in f["seeds"]]
    for kind, mixer, s in failing + ([("reference", reference, f["seeds"][0])] if reference else []):
        argv = [*failing_args, *_spec(mixer), *_common(failing_steps, (f["lr"],), s, None, f["batch"])]
        runs.append(Run(f"mqar_{kind}_{failing_label}_{mixer}_s{s}", argv))
    return runs


MAD_TASKS = ("in_context_recall", "noisy_recall", "fuzzy_recall", "selective_copying",
             "compression", "memorization")


def mad_protocol(tasks=MAD_TASKS, mixers=BASELINE_MIXERS, width=128, layers=2, steps=20000,
                 lrs=(1e-4, 5e-4, 1e-3), seed=0, time_limit=None, batch=128) -> list:
    """Each MAD task at its baseline setting per mixer, with the learning-rate sweep ``lrs``."""
    common = _common(steps, lrs, seed, time_limit, batch)
    return [Run(f"mad_{task}_{mixer}_s{seed}",
                ["--task", task, "--layers", str(layers), "--d-model", str(width), *_spec(mixer),
                 *common])
            for mixer in mixers for task in tasks]


def ou_ablation(depths=(2, 4, 8), task="a5", length=64, width=128, steps=20000, lrs=(1e-3,),
                seed=0, time_limit=None, batch=128, kv_pairs=None, vocab=None, filler=None) -> list:
    """KLA with the OU vs the zero-order-hold discretisation at each depth, on one task
    (``length=None``: the task's own length, e.g. a MAD task's baseline; ``kv_pairs`` (one value),
    ``vocab`` and ``filler`` for ``task="mqar"``)."""
    common = _common(steps, lrs, seed, time_limit, batch)
    at = [] if length is None else ["--len", str(length)]
    if kv_pairs is not None:
        if len(kv_pairs) != 1:
            raise ValueError(f"ou takes one kv_pairs value, got {list(kv_pairs)}")
        at += ["--kv-pairs", str(kv_pairs[0])]
    at += [] if vocab is None else ["--vocab", str(vocab)]
    at += [] if filler is None else ["--filler", filler]
    tag = "" if length is None else f"_L{length}"
    return [Run(f"ou_{task}{tag}_n{depth}_{mixer}_s{seed}",
                ["--task", task, *at, "--layers", str(depth), "--d-model", str(width),
                 *_spec(mixer), *common])
            for mixer in ("kla", "kla_zoh") for depth in depths]


def launch(runs, out_dir: str, parallel: int = 8, env: dict | None = None,
           poll_s: float = 0.5, python: str = sys.executable, checkpoint_dir: str | None = None,
           stop_after: float | None = None, min_start_s: float = MIN_START_S) -> list:
    """Run ``runs`` as ``<python> -m evidence.train`` processes, ``parallel`` at a time.

    Each writes ``<out_dir>/<label>.json`` and ``<out_dir>/<label>.log``; the repository root is
    put first on their ``PYTHONPATH`` (``evidence`` is not installed), so any working directory
    will do. Returns one dict per run:
    the JSON result, or ``{"label", "returncode", "log"}`` for a run that wrote none.
    ``checkpoint_dir`` gives each run ``--checkpoint <checkpoint_dir>/<label>.pt``; ``stop_after``
    (seconds, needs ``checkpoint_dir``) is the launch's budget: a run starts with the whole seconds
    left as its ``--stop-after``, and none starts with less than ``min_start_s`` left (those give
    ``{"label", "stopped": "not started"}``).
    """
    if parallel < 1:
        raise ValueError(f"parallel must be positive, got {parallel}")
    if stop_after is not None and checkpoint_dir is None:
        raise ValueError("stop_after needs checkpoint_dir")
    os.makedirs(out_dir, exist_ok=True)
    pending, active, results = list(runs), [], {}
    full_env = {**os.environ, **(env or {})}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # evidence is not installed
    full_env["PYTHONPATH"] = os.pathsep.join(x for x in (root, full_env.get("PYTHONPATH")) if x)
    deadline = None if stop_after is None else time.monotonic() + stop_after
    while pending or active:
        while pending and len(active) < parallel:
            left = None if deadline is None else math.floor(deadline - time.monotonic())
            if left is not None and left < min_start_s:
                results.update((r.label, {"label": r.label, "stopped": "not started"}) for r in pending)
                pending = []
                break
            run = pending.pop(0)
            log = open(os.path.join(out_dir, run.label + ".log"), "w")
            command = run.command(out_dir, python, checkpoint_dir=checkpoint_dir, stop_after=left)
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env)
            active.append((run, proc, log))
        time.sleep(poll_s)
        for item in [a for a in active if a[1].poll() is not None]:
            run, proc, log = item
            log.close()
            active.remove(item)
            path = os.path.join(out_dir, run.label + ".json")
            if proc.returncode == 0 and os.path.exists(path):
                with open(path) as fh:
                    results[run.label] = json.load(fh)
            else:
                results[run.label] = {"label": run.label, "returncode": proc.returncode,
                                      "log": log.name}
            print(f"[{len(results)}/{len(runs)}] {run.label}: {_status(results[run.label])}",
                  file=sys.stderr)
    if checkpoint_dir is not None:
        unfinished = sum(_unfinished(r) for r in results.values())
        print(f"{unfinished} of {len(runs)} runs unfinished" + (": run the same command again"
              if unfinished else ""), file=sys.stderr)
    return [results[r.label] for r in runs]


def _unfinished(result: dict) -> bool:
    """Not started or paused: the next call of the same command goes on with it."""
    runs = result.get("runs", ())
    return result.get("stopped") == "not started" or any(r["stopped"] == "paused" for r in runs)


def _status(result: dict) -> str:
    """A launched run's outcome in a few words: its best token accuracy, the last gradient norms
    recorded (whole model; each layer's mixer), and whether it paused."""
    if "best_token_acc" not in result:
        return result.get("stopped", "failed")
    norms = [(r["grad_norms"][-1][1], r["mixer_grad_norms"][-1][1:]) for r in result["runs"]
             if r.get("grad_norms")]
    shown = "".join(f", grad norm {total:.3g} (mixers {', '.join(f'{n:.3g}' for n in mixers)})"
                    for total, mixers in norms)
    return f"{result['best_token_acc']}{shown}" + (", paused" if _unfinished(result) else "")


def with_kla_options(runs, options) -> list:
    """``runs`` with ``--mixer-opt KEY=VALUE`` added for each of ``options`` to the KLA runs."""
    extra = [arg for opt in options for arg in ("--mixer-opt", opt)]
    return [Run(r.label, [*r.argv, *extra]) if "kla" in r.argv else r for r in runs]


PROTOCOLS = {"a5": a5_min_depth, "mqar": mqar_protocol, "mad": mad_protocol, "ou": ou_ablation,
             "mqar_control": mqar_control}


def main(argv=None) -> list:
    p = argparse.ArgumentParser(prog="python -m evidence.protocols", description=__doc__.split("\n")[0])
    p.add_argument("protocol", choices=sorted(PROTOCOLS))
    p.add_argument("--mixers", nargs="+", default=None, choices=sorted(MIXER_SPECS))
    p.add_argument("--lengths", nargs="+", type=int, default=None)
    p.add_argument("--depths", nargs="+", type=int, default=None)
    p.add_argument("--kv-pairs", nargs="+", type=int, default=None)
    p.add_argument("--widths", nargs="+", type=int, default=None)
    p.add_argument("--tasks", nargs="+", default=None)
    p.add_argument("--lrs", nargs="+", type=float, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None, help="mqar: vocabulary size (default 8192)")
    p.add_argument("--filler", choices=("random", "zero"), default=None,
                   help="mqar: tokens between the queries (default zero, as Zoology's paper)")
    p.add_argument("--seed", type=int, default=None, help="the protocol's default if omitted (0; mqar_control 1)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per learning rate per run")
    p.add_argument("--no-control", action="store_true",
                   help="a5: leave out the controls (Z60, and the GRU on A5)")
    p.add_argument("--task", default=None,
                   help="ou: the one task (default a5 at length 64; a MAD task runs at its own length "
                        "unless --lengths gives one)")
    p.add_argument("--kla-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a --mixer-opt for the KLA runs only (e.g. backend=torch)")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--checkpoint-dir", default=None,
                   help="each run pauses and resumes with --checkpoint DIR/<label>.pt")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="with --checkpoint-dir: this launch's budget; runs pause when it ends")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    names = {"mixers": a.mixers, "lengths": a.lengths, "depths": a.depths, "kv_pairs": a.kv_pairs,
             "widths": a.widths, "tasks": a.tasks, "lrs": a.lrs, "steps": a.steps, "batch": a.batch,
             "time_limit": a.time_limit, "seed": a.seed, "filler": a.filler, "vocab": a.vocab}
    if a.protocol == "a5" and a.no_control:
        names["control"] = names["recurrent_control"] = None
    if a.protocol == "ou":
        if a.lengths is not None and len(a.lengths) != 1:
            raise ValueError("ou takes one length")
        names["length"] = a.lengths[0] if a.lengths else (64 if a.task in (None, "a5") else None)
        names["lengths"] = None
        if a.task is not None:
            names["task"] = a.task
    elif a.task is not None:
        raise ValueError("--task is for the ou protocol; use --tasks for mad")
    fn = PROTOCOLS[a.protocol]
    accepted = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    controls = ("control", "recurrent_control")
    given = {k: v for k, v in names.items() if v is not None or k in ("length", *controls)}
    unknown = sorted(k for k in given if k not in accepted and k not in controls)
    if unknown:
        raise ValueError(f"protocol {a.protocol!r} takes no option(s) {unknown}")
    runs = with_kla_options(fn(**given), a.kla_opt)
    out_dir = a.out_dir or os.path.join("benchmarks", "results", a.protocol)
    resume = {"checkpoint_dir": a.checkpoint_dir, "stop_after": a.stop_after}
    if a.stop_after is not None and a.checkpoint_dir is None:
        raise ValueError("--stop-after needs --checkpoint-dir")
    if a.checkpoint_dir is not None:
        from .train import parse_args   # the checks of --checkpoint, before any run starts

        for run in runs:
            parse_args(run.train_argv(out_dir, **resume))
    if a.dry_run:
        for run in runs:
            print(shlex.join(run.command(out_dir, **resume)))
        return []
    return launch(runs, out_dir, a.parallel, **resume)


if __name__ == "__main__":
    main()
