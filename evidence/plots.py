"""Figures and tables from the JSON results of :mod:`evidence.train`.

    python -m evidence.plots a5 benchmarks/results/a5 --png benchmarks/results/a5_min_depth.png

    python -m evidence.plots mad benchmarks/results/mad --png benchmarks/results/mad.png
    python -m evidence.plots mqar benchmarks/results/mqar --png benchmarks/results/mqar.png

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
    """Every result JSON under ``directory`` and its subfolders (runs that wrote none are absent)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "**", "*.json"), recursive=True)):
        with open(path) as fh:
            out.append(json.load(fh))
    return out


def mixer_label(result: dict) -> str:
    """The protocol's name of a run's mixer: ``kla``, ``kla_noise0``, ``kla_zoh`` or the mixer,
    with any other mixer options in brackets (``gla[expand_k=2]``)."""
    label = result["mixer"].replace(",", "-")
    if result.get("noise_zero"):
        label += "_noise0"
    opts = dict(result.get("mixer_opts", {}))
    if opts.pop("discretization", None) == "zoh":
        label += "_zoh"
    if opts:
        label += "[" + ",".join(f"{k}={v}" for k, v in sorted(opts.items())) + "]"
    return label


def _rates(result: dict) -> str:
    return ",".join(f"{run['lr']:g}" for run in result.get("runs", []))


def run_labels(results, rates: bool = True) -> list:
    """One label per result: :func:`mixer_label`, plus the width, the seed and (with ``rates``)
    the learning rates where those differ among ``results``, so such runs of one mixer stay apart."""
    parts = (lambda r: f" d_model {r.get('d_model')}", lambda r: f" seed {r.get('seed')}",
             lambda r: f" lr {_rates(r)}")[: 3 if rates else 2]
    varying = [part for part in parts if len({part(r) for r in results}) > 1]
    return [mixer_label(r) + "".join(part(r) for part in varying) for r in results]


def index(results, task: str) -> dict:
    """``{(label, depth, length): result}`` for the runs of ``task`` (labels of :func:`run_labels`);
    two runs that would share a key raise ``ValueError``."""
    runs = [r for r in results if r["task"] == task]
    out: dict = {}
    for label, r in zip(run_labels(runs), runs):
        key = (label, r["layers"], r["seq_len"])
        if key in out:
            raise ValueError(f"two {task} runs share mixer, depth, length, width, seed and rates: "
                             f"{key}")
        out[key] = r
    return out


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
    steps = _best_run(r)["steps_run"]
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
    """Markdown: the smallest solving depth per mixer and length; ``> d`` where no depth up to
    ``d`` (the deepest tried for that mixer and length) solved, ``–`` where none was tried."""
    table = min_depths(results, task)
    deepest: dict = {}
    for mixer, depth, length in index(results, task):
        deepest[mixer, length] = max(depth, deepest.get((mixer, length), depth))
    lengths = sorted({n for row in table.values() for n in row})
    lines = ["| mixer | " + " | ".join(f"L={n}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for mixer, row in sorted(table.items()):
        cells = ["–" if n not in row else str(row[n]) if row[n] is not None
                 else f"> {deepest[mixer, n]}" for n in lengths]
        lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibration_markdown(results, task: str = "a5", tasks: tuple = ()) -> str:
    """Markdown: per KLA run, the final model's error rate and how well the last KLA layer's
    output variance flags its errors (AUROC; 0.5 = no better than chance), beside the softmax
    confidence's AUROC; where runs have it, the toolkit's check of the layer's filters on their
    own observations (mean NIS, 1 when honest; the fraction of ``v`` in the 90% predictive
    interval). With ``tasks``, one table over those tasks with a task column."""
    rows = []
    for name in tasks or (task,):
        for (mixer, depth, length), r in sorted(index(results, name).items()):
            run = _best_run(r)
            cal = run.get("calibration") if run else None
            if cal:
                rows.append((name, mixer, depth, length, cal))
    filters = any(cal.get("filters") for *_, cal in rows)
    head = "| task " if tasks else ""
    extra = " filter NIS | v in 90% band |" if filters else ""
    lines = [head + "| mixer | depth | L | error rate | mean var (wrong / right) | AUROC var | "
             "AUROC var within position | AUROC softmax |" + extra,
             "|---" * (8 + bool(tasks) + 2 * filters) + "|"]
    num = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for name, mixer, depth, length, cal in rows:
        f = cal.get("filters") or {}
        tail = (f" {num(f.get('mean_nis'), '.3g')} | {num(f.get('coverage', {}).get('0.9'), '.3f')} |"
                if filters else "")
        lines.append(
            (f"| {name} " if tasks else "") +
            f"| {mixer} | {depth} | {length} | {num(cal['error_rate'], '.3f')} | "
            f"{num(cal['mean_var_wrong'], '.3g')} / {num(cal['mean_var_correct'], '.3g')} | "
            f"{num(cal['auroc_var'], '.3f')} | {num(cal['auroc_var_by_position'], '.3f')} | "
            f"{num(cal['auroc_confidence'], '.3f')} |" + tail)
    return "\n".join(lines)


MAD_ORDER = ("in_context_recall", "noisy_recall", "fuzzy_recall", "selective_copying",
             "compression", "memorization")


def _best_run(r: dict) -> dict | None:
    return next((x for x in r.get("runs", []) if x["lr"] == r.get("best_lr")), None)


def best_over_rates(results) -> list:
    """``results`` with, of the runs that differ only in their learning rates, the one with the
    best validation token accuracy (the MAD protocol's reading of a rate sweep)."""
    best: dict = {}
    for r in results:
        key = (r["task"], mixer_label(r), r.get("d_model"), r.get("seed"), r.get("layers"),
               r.get("seq_len"))
        if key not in best or (r.get("best_token_acc") or 0) > (best[key].get("best_token_acc") or 0):
            best[key] = r
    return list(best.values())


def swept(results) -> bool:
    """Whether some run of ``results`` differs from another only in its learning rates."""
    return len(best_over_rates(results)) < len(results)


def mad_table(results, rates: bool = True) -> dict:
    """``{mixer: {task: result}}`` for the MAD runs among ``results`` (labels of
    :func:`run_labels`; ``rates=False`` for results with one rate per mixer and task)."""
    table: dict = {}
    runs = [r for r in results if r["task"] in MAD_ORDER]
    for label, r in zip(run_labels(runs, rates), runs):
        if r["task"] in table.get(label, {}):
            raise ValueError(f"two {r['task']} runs share mixer, width, seed and rates: {label}")
        table.setdefault(label, {})[r["task"]] = r
    return table


def mad_markdown(results, best_rate: bool = False) -> str:
    """Markdown: rows mixers, columns the MAD tasks present; best validation token accuracy and
    macro accuracy (per-class recall averaged) in %, ✓ where solved, steps run in brackets; last
    column the mean token accuracy over the tasks. ``best_rate``: one row per mixer with the best
    of its learning rates per task (:func:`best_over_rates`), the rate after ``@``."""
    if best_rate:
        results = best_over_rates(results)
    table = mad_table(results, rates=not best_rate)
    tasks = [t for t in MAD_ORDER if any(t in row for row in table.values())]
    lines = ["| mixer | " + " | ".join(t.replace("_", " ") for t in tasks) + " | mean |",
             "|---|" + "---|" * (len(tasks) + 1)]
    for mixer, row in sorted(table.items()):
        cells, accs = [], []
        for task in tasks:
            r = row.get(task)
            run = _best_run(r) if r else None
            if run is None or run["best"] is None:
                cells.append(_fmt(r))
                continue
            best = run["best"]
            accs.append(best["token_acc"])
            mark = " ✓" if r["solved"] else ""
            rate = f" @{run['lr']:g}" if best_rate else ""
            cells.append(f"{100 * best['token_acc']:.1f} / {100 * best['macro_acc']:.1f}{mark} "
                         f"[{run['steps_run']}]{rate}")
        mean = f"{100 * sum(accs) / len(accs):.1f}" if len(accs) == len(tasks) else "–"
        lines.append(f"| {mixer} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def mqar_markdown(results) -> str:
    """Markdown: one row per MQAR run (length, kv pairs, d_model, mixer, rate, seed): best mean
    per-sequence accuracy (MQAR's measure), token accuracy, the step it was reached, steps run,
    final training loss and parameter count."""
    lines = ["| T | kv pairs | d_model | mixer | rate | seed | mean seq. acc. (%) | "
             "token acc. (%) | at step | steps run | final loss | parameters |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [r for r in results if r["task"] == "mqar"]
    rows.sort(key=lambda r: (r["seq_len"], r["config"].get("kv_pairs") or 0, r["d_model"],
                             mixer_label(r), r["best_lr"] or 0, r["seed"]))
    for r in rows:
        run = _best_run(r)
        rate = r["best_lr"] if run is None else run["lr"]
        head = (f"| {r['seq_len']} | {r['config'].get('kv_pairs')} | {r['d_model']} | "
                f"{mixer_label(r)} | {rate:g} | {r['seed']} |")
        if run is None or run["best"] is None:
            lines.append(f"{head} {_fmt(r)} | | | | | |")
            continue
        best = run["best"]
        lines.append(f"{head} {100 * best['mean_seq_acc']:.2f} | "
                     f"{100 * best['token_acc']:.2f} | {best['step']} | {run['steps_run']} | "
                     f"{run['final_loss']:.3f} | {run['n_params']:,} |")
    return "\n".join(lines)


def _leaves(state):
    if isinstance(state, (tuple, list)):
        return [t for s in state for t in _leaves(s)]
    return [state]


def state_floats(result: dict) -> int:
    """Floats that a model of ``result``'s configuration carries from one token to the next after
    reading ``seq_len`` tokens (batch 1, every layer; attention: its key/value cache, which grows
    with the length; recurrent mixers: their state and convolution buffers)."""
    import torch

    from .train import build_model, task_from_args

    args = argparse.Namespace(**result["config"])
    model = build_model(task_from_args(args), args)
    with torch.no_grad():
        tokens = torch.zeros(1, result["seq_len"], dtype=torch.long)
        _, state = model(tokens, model.init_state(1, device="cpu"))
    return sum(t.numel() for t in _leaves(state) if torch.is_tensor(t) and t.is_floating_point())


def plot_mqar(results, path: str) -> None:
    """MQAR best mean per-sequence accuracy (over the rates and seeds run) against the state a
    model carries between tokens (:func:`state_floats`, log scale), one line per (mixer, T, kv
    pairs) through its widths (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = {}
    for r in (r for r in results if r["task"] == "mqar"):
        run = _best_run(r)
        acc = 0.0 if run is None or run["best"] is None else run["best"]["mean_seq_acc"]
        key = (mixer_label(r), r["seq_len"], r["config"].get("kv_pairs"), r["d_model"])
        if key not in best or acc > best[key][0]:
            best[key] = (acc, r)
    if not best:
        raise ValueError("no MQAR results")
    fig, ax = plt.subplots(figsize=(5.8, 3.8), dpi=130)
    for line in sorted({k[:3] for k in best}):
        points = sorted((state_floats(r), 100 * acc) for k, (acc, r) in best.items()
                        if k[:3] == line)
        ax.plot(*zip(*points), marker="o", label=f"{line[0]} (T {line[1]}, {line[2]} pairs)")
    ax.set_xscale("log")
    ax.set_xlabel("floats carried between tokens (all layers)")
    ax.set_ylabel("best mean per-sequence accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title("MQAR: accuracy against state size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_mad(results, path: str) -> None:
    """Bars of the best validation token accuracy per MAD task, one bar per mixer (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = mad_table(results)
    if not table:
        raise ValueError("no MAD results")
    tasks = [t for t in MAD_ORDER if any(t in row for row in table.values())]
    width = 0.8 / len(table)
    fig, ax = plt.subplots(figsize=(1.4 * len(tasks) + 1.5, 3.6), dpi=130)
    for i, (mixer, row) in enumerate(sorted(table.items())):
        accs = [100 * (row[t].get("best_token_acc") or 0) if t in row else 0 for t in tasks]
        ax.bar([j + (i - (len(table) - 1) / 2) * width for j in range(len(tasks))], accs, width,
               label=mixer)
    ax.set_xticks(range(len(tasks)), [t.replace("_", "\n") for t in tasks], fontsize=8)
    ax.set_ylabel("best validation token accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title("MAD synthetic tasks")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=len(table), loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_rates(results, path: str) -> None:
    """Best validation token accuracy against learning rate (log scale), one panel per MAD task
    with runs at more than one rate, one line per mixer (labels of :func:`run_labels` without the
    rates), from every run's rates (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r["task"] in MAD_ORDER]
    points: dict = {}
    for label, r in zip(run_labels(runs, rates=False), runs):
        for run in r.get("runs", []):
            acc = 0.0 if run["best"] is None else 100 * run["best"]["token_acc"]
            points.setdefault(r["task"], {}).setdefault(label, []).append((run["lr"], acc))
    tasks = [t for t in MAD_ORDER if len({lr for line in points.get(t, {}).values()
                                          for lr, _ in line}) > 1]
    if not tasks:
        raise ValueError("no MAD task has runs at more than one learning rate")
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.4 * len(tasks), 3.2), dpi=130,
                             squeeze=False, sharey=True)
    for ax, task in zip(axes[0], tasks):
        for label, line in sorted(points[task].items()):
            ax.plot(*zip(*sorted(line)), marker="o", label=label)
        ax.set_xscale("log")
        ax.set_title(task.replace("_", " "))
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("best validation token accuracy (%)")
    axes[0][0].set_ylim(0, 105)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_min_depth(results, path: str, task: str = "a5") -> None:
    """Draw the smallest solving depth against length per mixer to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = min_depths(results, task)
    if not table:
        raise ValueError(f"no results for task {task!r}")
    top = max(k[1] for k in index(results, task)) + 1
    depths_axis = list(range(1, top))
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=130)
    offsets = {m: 0.06 * (i - (len(table) - 1) / 2) for i, m in enumerate(sorted(table))}
    for mixer, row in sorted(table.items()):
        lengths = sorted(row)
        depths = [row[n] if row[n] is not None else top for n in lengths]
        ax.plot(lengths, [d + offsets[mixer] for d in depths], marker="o", label=mixer)
    ax.set_xscale("log", base=2)
    all_lengths = sorted({n for row in table.values() for n in row})
    ax.set_xticks(all_lengths, [str(n) for n in all_lengths])
    ax.set_yticks([*depths_axis, top], [*map(str, depths_axis), "not solved"])
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
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
        for (mixer, depth, n), r in sorted(idx.items()):
            run = _best_run(r)
            if n != length or not run or not run["history"]:
                continue
            steps, _, acc = zip(*run["history"])
            ax.plot(steps, [100 * a for a in acc], label=f"{mixer} x{depth}",
                    linestyle="-" if depth == 1 else "--")
        ax.set_title(f"{task.upper()}, L = {length}")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation token accuracy (%)")
    fig.tight_layout()
    fullest = max(axes[0], key=lambda ax: len(ax.get_lines()))
    if fullest.get_lines():
        axes[0][-1].legend(*fullest.get_legend_handles_labels(), fontsize=7, loc="upper left",
                           bbox_to_anchor=(1.02, 1.0))
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m evidence.plots", description=__doc__.split("\n")[0])
    p.add_argument("task", help="task name as in the results (a5, z60, mqar, ...)")
    p.add_argument("directories", nargs="+", metavar="directory",
                   help="folders of result JSON (searched recursively), read together")
    p.add_argument("--png", default=None,
                   help="write the smallest-solving-depth plot here (mad: the accuracy bars; "
                        "mqar: accuracy against state size)")
    p.add_argument("--curves", default=None, help="write the learning curves here")
    p.add_argument("--rates", default=None, help="mad: write accuracy against learning rate here")
    a = p.parse_args(argv)
    results = [r for d in a.directories for r in load(d)]
    if a.task == "mad":
        parts = [mad_markdown(results)]
        if swept(results):
            parts.append("Best learning rate per task and mixer:\n\n" + mad_markdown(results, True))
        text = "\n\n".join(parts + [calibration_markdown(results, tasks=MAD_ORDER)])
        if a.png:
            plot_mad(best_over_rates(results), a.png)
        if a.rates:
            plot_rates(results, a.rates)
    elif a.task == "mqar":
        widths = sorted({r["d_model"] for r in results if r["task"] == "mqar"})
        text = "\n\n".join([mqar_markdown(results)] + [
            f"d_model = {d}:\n\n" + calibration_markdown([r for r in results if r["d_model"] == d],
                                                         "mqar") for d in widths])
        if a.png:
            plot_mqar(results, a.png)
    else:
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
