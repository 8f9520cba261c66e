"""Figures and tables from the JSON results of :mod:`benchmarks.train`.

    python -m benchmarks.plots a5 benchmarks/results/a5 --png benchmarks/results/a5_min_depth.png

prints markdown tables (best validation token accuracy per mixer, depth and length; the smallest
solving depth) and draws the A5 smallest-solving-depth plot: one line per mixer, length on the x
axis (log 2), the smallest depth whose best validation token accuracy passed the threshold on the
y axis; a mixer unsolved at every depth tried is drawn above the largest depth, as "not solved".
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def load(directory: str) -> list:
    """Every result JSON under ``directory`` (runs that wrote none are absent)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as fh:
            out.append(json.load(fh))
    return out


def mixer_label(result: dict) -> str:
    """The protocol's name of a run's mixer: ``kla``, ``kla_noise0``, ``kla_zoh`` or the mixer."""
    label = result["mixer"].replace(",", "-")
    if result.get("noise_zero"):
        label += "_noise0"
    if result.get("mixer_opts", {}).get("discretization") == "zoh":
        label += "_zoh"
    return label


def index(results, task: str) -> dict:
    """``{(mixer, depth, length): result}`` for the runs of ``task``."""
    return {(mixer_label(r), r["layers"], r["seq_len"]): r for r in results if r["task"] == task}


def min_depths(results, task: str = "a5") -> dict:
    """``{mixer: {length: smallest solving depth or None}}`` over the depths tried."""
    table: dict = {}
    for (mixer, depth, length), r in sorted(index(results, task).items()):
        row = table.setdefault(mixer, {})
        row.setdefault(length, None)
        if r["solved"] and (row[length] is None or depth < row[length]):
            row[length] = depth
    return table


def _fmt(r) -> str:
    if r is None:
        return "–"
    acc = r.get("best_token_acc")
    if acc is None:
        runs = r.get("runs", [])
        if runs and all(run["stopped"] == "nonfinite" for run in runs):
            return f"non-finite at step {min(run['steps_run'] for run in runs)}"
        return "failed"
    steps = next(run["steps_run"] for run in r["runs"] if run["lr"] == r["best_lr"])
    diverged = any(run["stopped"] == "nonfinite" for run in r["runs"])
    mark = " ✓" if r["solved"] else (" (non-finite)" if diverged else "")
    return f"{100 * acc:.1f}{mark} [{steps}]"


def accuracy_markdown(results, task: str = "a5") -> str:
    """Markdown: rows (mixer, depth), columns lengths; best validation token accuracy in %,
    ✓ where solved, and in brackets the steps run (of the best learning rate's run)."""
    idx = index(results, task)
    lengths = sorted({k[2] for k in idx})
    rows = sorted({k[:2] for k in idx})
    lines = ["| mixer | depth | " + " | ".join(f"L={n}" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for mixer, depth in rows:
        cells = [_fmt(idx.get((mixer, depth, n))) for n in lengths]
        lines.append(f"| {mixer} | {depth} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def min_depth_markdown(results, task: str = "a5") -> str:
    table = min_depths(results, task)
    lengths = sorted({n for row in table.values() for n in row})
    tried = sorted({k[1] for k in index(results, task)})
    lines = ["| mixer | " + " | ".join(f"L={n}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for mixer, row in sorted(table.items()):
        cells = [str(row.get(n)) if row.get(n) is not None else f"> {max(tried)}" for n in lengths]
        lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibration_markdown(results, task: str = "a5") -> str:
    """Markdown: per KLA run, the final model's error rate and how well the last KLA layer's
    output variance flags its errors (AUROC; 0.5 = no better than chance), beside the softmax
    confidence's AUROC."""
    lines = ["| mixer | depth | L | error rate | mean var (wrong / right) | AUROC var | "
             "AUROC var within position | AUROC softmax |", "|---|---|---|---|---|---|---|---|"]
    num = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for (mixer, depth, length), r in sorted(index(results, task).items()):
        run = next((x for x in r.get("runs", []) if x["lr"] == r.get("best_lr")), None)
        cal = run.get("calibration") if run else None
        if not cal:
            continue
        lines.append(
            f"| {mixer} | {depth} | {length} | {num(cal['error_rate'], '.3f')} | "
            f"{num(cal['mean_var_wrong'], '.3g')} / {num(cal['mean_var_correct'], '.3g')} | "
            f"{num(cal['auroc_var'], '.3f')} | {num(cal['auroc_var_by_position'], '.3f')} | "
            f"{num(cal['auroc_confidence'], '.3f')} |")
    return "\n".join(lines)


def plot_min_depth(results, path: str, task: str = "a5") -> None:
    """Draw the smallest solving depth against length per mixer to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = min_depths(results, task)
    tried = sorted({k[1] for k in index(results, task)})
    if not table:
        raise ValueError(f"no results for task {task!r}")
    top = max(tried) + 1
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=130)
    offsets = {m: 0.06 * (i - (len(table) - 1) / 2) for i, m in enumerate(sorted(table))}
    for mixer, row in sorted(table.items()):
        lengths = sorted(row)
        depths = [row[n] if row[n] is not None else top for n in lengths]
        ax.plot(lengths, [d + offsets[mixer] for d in depths], marker="o", label=mixer)
    ax.set_xscale("log", base=2)
    all_lengths = sorted({n for row in table.values() for n in row})
    ax.set_xticks(all_lengths, [str(n) for n in all_lengths])
    ax.set_yticks([*tried, top], [*map(str, tried), "not solved"])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("smallest depth solving (>90% token acc.)")
    ax.set_title(f"{task.upper()} word problem: smallest solving depth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_curves(results, path: str, task: str = "a5") -> None:
    """Validation token accuracy against training step, one panel per length, one line per
    (mixer, depth), from the best learning rate's history; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = index(results, task)
    lengths = sorted({k[2] for k in idx})
    if not lengths:
        raise ValueError(f"no results for task {task!r}")
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), dpi=130,
                             squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        for (mixer, depth, n), r in sorted(idx.items()):
            run = next((x for x in r.get("runs", []) if x["lr"] == r.get("best_lr")), None)
            if n != length or not run or not run["history"]:
                continue
            steps, _, acc = zip(*run["history"])
            ax.plot(steps, [100 * a for a in acc], label=f"{mixer} x{depth}",
                    linestyle="-" if depth == 1 else "--")
        ax.set_title(f"{task.upper()}, L = {length}")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation token accuracy (%)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.split("\n")[0])
    p.add_argument("task", help="task name as in the results (a5, z60, mqar, ...)")
    p.add_argument("directory")
    p.add_argument("--png", default=None, help="write the smallest-solving-depth plot here")
    p.add_argument("--curves", default=None, help="write the learning curves here")
    a = p.parse_args(argv)
    results = load(a.directory)
    text = "\n\n".join([accuracy_markdown(results, a.task), min_depth_markdown(results, a.task),
                         calibration_markdown(results, a.task)])
    if a.png:
        plot_min_depth(results, a.png, a.task)
    if a.curves:
        plot_curves(results, a.curves, a.task)
    print(text)
    return text


if __name__ == "__main__":
    main()
