"""Tables and learning curves of the byte-level language-model runs (:mod:`evidence.lm`).

    python -m evidence.lm_report benchmarks/results/text [more folders] \
        --throughput benchmarks/results/text/throughput.json \
        --figure docs/img/text_curves.png [--samples]

Reads every run JSON under the folders (the sweep's runs, ``tokens_fraction < 1``, apart) and
prints markdown: a row per model with its parameters, seeds, final held-out bits per byte (mean
+- half the range over seeds), the training loss at the end and the lowest held-out bits per byte
on the curve (where a model memorises a small corpus the two part), held-out bits per byte at
equal wall-clock, training tokens/s, and
the AUROC of the last KLA layer's output variance beside the softmax confidence's as detectors of
wrongly predicted bytes; then the sweep's table (held-out bits per byte at the end of each rate's
run); with ``--samples`` each model's generations from the first prompt.

Equal wall-clock: runs that share a GPU take longer than alone, so time is estimated as
``tokens / tokens_per_s`` with each model's throughput timed alone (``python -m evidence.lm
throughput``; without it, the fastest of each model's runs, from its own training tokens/s: a run
that shared its GPU only lost speed). The budget is the time the fastest
model took for its whole token budget; every model's held-out bits per byte is read on its curve
(against tokens, linear between evaluations) at the tokens it trains in that time. The curve is
the periodic evaluation's, on the fixed held-out subset that every run shares, not the whole
split of the "end" column: the two columns differ a little even for the fastest model. A model cut
short there has not finished its learning-rate decay, so the column favours the fast model; it
answers "which model is better per second of this budget", not "per second of its own schedule".
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np

TOKENS, TRAIN, BPB = 1, 3, 5    # columns of a history row: [step, tokens, train_s, train_bpb, grad_norm, heldout_bpb]


def load_runs(*directories: str) -> tuple[list, list]:
    """The ``(main, sweep)`` run JSONs under each of ``directories`` (recursively); other JSON is
    skipped."""
    main, sweep = [], []
    paths = [path for d in directories for path in glob.glob(os.path.join(d, "**", "*.json"), recursive=True)]
    for path in sorted(paths):
        with open(path) as fh:
            result = json.load(fh)
        if "history" not in result or "model" not in result:
            continue
        (sweep if result["config"]["tokens_fraction"] < 1 else main).append(result)
    return main, sweep


def load_throughput(path: str | None) -> dict:
    """``{model: tokens_per_s}`` from a throughput JSON (``{}`` for ``None``)."""
    if path is None:
        return {}
    with open(path) as fh:
        return {name: m["tokens_per_s"] for name, m in json.load(fh)["models"].items()}


def by_model(runs) -> dict:
    """``{model: [runs sorted by seed]}`` for the runs that finished."""
    out = {}
    for r in sorted(runs, key=lambda r: (r["model"], r["seed"])):
        if r["stopped"] == "steps":
            out.setdefault(r["model"], []).append(r)
    return out


def curve(run: dict, column: int = BPB) -> tuple[np.ndarray, np.ndarray]:
    """Held-out bits per byte (``column=TRAIN``: the training loss in bits per byte, the mean
    since the previous evaluation) against training tokens, at the periodic evaluations."""
    rows = np.asarray(run["history"], dtype=np.float64)
    return rows[:, TOKENS], rows[:, column]


def best(runs) -> str:
    """The lowest held-out bits per byte on each run's curve, mean over seeds, and where (mean
    millions of training bytes): a model that memorises its training set passes it and rises."""
    lows = [(bpb.min(), tokens[bpb.argmin()]) for tokens, bpb in map(curve, runs)]
    return f"{np.mean([b for b, _ in lows]):.4f} ({np.mean([t for _, t in lows]) / 1e6:.0f}M)"


def rates(models: dict, throughput: dict) -> dict:
    """Tokens/s per model: timed alone when given, else the highest of its runs' own (a run that
    shared its GPU is slower, never faster, than one alone)."""
    return {m: throughput.get(m, max(r["tokens_per_s"] for r in runs)) for m, runs in models.items()}


def equal_time(models: dict, speed: dict) -> tuple[float, dict]:
    """The fastest model's time for its whole budget, and each model's mean held-out bits per
    byte at the tokens it trains in that time (see the module doc)."""
    budget = min(np.mean([r["tokens_run"] for r in runs]) / speed[m] for m, runs in models.items())
    at = {}
    for m, runs in models.items():
        tokens = budget * speed[m]
        at[m] = float(np.mean([np.interp(tokens, *curve(r)) for r in runs]))
    return budget, at


def _mean_spread(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    spread = (max(values) - min(values)) / 2
    return f"{np.mean(values):.4f} +- {spread:.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def _auroc(runs) -> str:
    cal = [r["calibration"] for r in runs if r.get("calibration")]
    if not cal:
        return "-"
    var = [c["auroc_var"] for c in cal if c["auroc_var"] is not None]
    conf = [c["auroc_confidence"] for c in cal if c["auroc_confidence"] is not None]
    return f"{np.mean(var):.3f} / {np.mean(conf):.3f}" if var and conf else "-"


def main_markdown(main: list, throughput: dict) -> str:
    """The row per model (see the module doc)."""
    models = by_model(main)
    if not models:
        return "no finished runs"
    speed = rates(models, throughput)
    budget, at = equal_time(models, speed)
    lines = ["| model | params | seeds | held-out bpb (end) | train bpb (end) | best subset bpb (at bytes) | "
             f"subset bpb at equal time ({budget:.3g} s) | tokens/s | AUROC variance / confidence |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, runs in sorted(models.items(), key=lambda kv: np.mean([r["final_bpb"] for r in kv[1]])):
        train = _mean_spread([curve(r, TRAIN)[1][-1] for r in runs])
        lines.append(f"| {m} | {runs[0]['n_params'] / 1e6:.2f}M | {len(runs)} | "
                     f"{_mean_spread([r['final_bpb'] for r in runs])} | {train} | {best(runs)} | {at[m]:.4f} | "
                     f"{speed[m]:,.0f} | {_auroc(runs)} |")
    return "\n".join(lines)


def sweep_markdown(sweep: list) -> str:
    """Held-out bits per byte at the end of each sweep run, a row per model, a column per rate."""
    if not sweep:
        return ""
    lrs = sorted({r["lr"] for r in sweep})
    cells = {(r["model"], r["lr"]): r for r in sweep}
    lines = ["| model | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---:|" * len(lrs)]
    for m in sorted({r["model"] for r in sweep}):
        row = []
        for lr in lrs:
            r = cells.get((m, lr))
            done = r is not None and r["stopped"] == "steps"
            row.append(f"{r['final_bpb']:.4f}" if done else "-")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    fraction = sweep[0]["config"]["tokens_fraction"]
    return f"Rate sweep (held-out bpb after the first {fraction:.0%} of the schedule):\n\n" + "\n".join(lines)


def samples_markdown(main: list) -> str:
    """The first prompt's greedy and sampled continuations of each model's first seed."""
    parts = []
    for m, runs in by_model(main).items():
        s = runs[0]["samples"][0]
        parts.append(f"**{m}** (seed {runs[0]['seed']}), greedy then temperature 0.8, top-k 40:\n\n"
                     f"```\n{s['prompt']}|>>|{s['greedy']}\n```\n```\n{s['prompt']}|>>|{s['sampled']}\n```")
    return "\n\n".join(parts)


def plot_text_curves(main: list, throughput: dict, path: str) -> None:
    """Held-out bits per byte against training tokens (with the training loss, thin) and against
    estimated wall-clock (tokens over the model's tokens/s, see :func:`rates`), a colour per model,
    a line style per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = by_model(main)
    speed = rates(models, throughput)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=130, sharey=True)
    for i, (m, runs) in enumerate(sorted(models.items())):
        for r, style in zip(runs, ("-", "--", ":")):
            tokens, bpb = curve(r)
            label = m if style == "-" else None
            axes[0].plot(tokens / 1e6, bpb, style, color=f"C{i}", label=label)
            axes[0].plot(tokens / 1e6, curve(r, TRAIN)[1], style, color=f"C{i}", lw=0.8, alpha=0.5)
            axes[1].plot(tokens / speed[m] / 60, bpb, style, color=f"C{i}", label=label)
    axes[0].set_xlabel("training tokens (millions of bytes)")
    axes[1].set_xlabel("training time alone on the GPU (minutes, from tokens/s)")
    axes[0].set_ylabel("held-out bits per byte (thin: training)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m evidence.lm_report", description=__doc__.split("\n")[0])
    p.add_argument("directories", nargs="+", help="folders of the runs' JSON (searched recursively)")
    p.add_argument("--throughput", default=None, help="JSON of python -m evidence.lm throughput")
    p.add_argument("--figure", default=None, help="write the learning curves here (PNG)")
    p.add_argument("--samples", action="store_true", help="print each model's generated samples")
    a = p.parse_args(argv)
    main_runs, sweep = load_runs(*a.directories)
    if not main_runs and not sweep:
        raise ValueError(f"directories {a.directories!r} hold no run JSON of evidence.lm")
    throughput = load_throughput(a.throughput)
    parts = [main_markdown(main_runs, throughput), sweep_markdown(sweep)]
    if a.samples:
        parts.append(samples_markdown(main_runs))
    if a.figure and by_model(main_runs):
        plot_text_curves(main_runs, throughput, a.figure)
    text = "\n\n".join(p for p in parts if p)
    print(text)
    return text


if __name__ == "__main__":
    main()
