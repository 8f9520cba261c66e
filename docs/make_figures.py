"""Regenerate the figures of docs/calibration.md: ``python docs/make_figures.py [outdir]``.

Uses the bundled synthetic sensors (irregular times, gaps, known truth) and a model simulated with
known parameters, filtered with the right ``obs_var`` and with ``obs_var`` misstated by 4x either
way. Deterministic (fixed seeds); CPU only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kalmanscan as ks  # noqa: E402

CASES = (("right obs_var", 1.0), ("obs_var x 4 (over-dispersed)", 4.0), ("obs_var / 4 (under-dispersed)", 0.25))


def main(outdir: Path, dpi: int = 110) -> list:
    outdir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = outdir / name
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)

    data = ks.datasets.sensors(T=400, seed=0)
    post = ks.smooth(data.y, times=data.times, **data.params)
    fig, ax = plt.subplots(figsize=(10, 3.8), layout="constrained")
    ks.plot.belief_band(post, data.y, channel=0, ax=ax, truth=data.truth,
                        title="smoothed belief, sensor 'temperature' (irregular times, gaps shaded)")
    ax.set_xlabel(f"time ({data.time_unit})")
    save(fig, "belief_band.png")

    fig, axes = plt.subplots(2, 1, figsize=(10, 6.0), layout="constrained", sharex=True)
    x, y = ks.datasets.simulate(theta=0.1, sigma=0.5, obs_var=0.5, T=200, seed=2)
    y[80:110] = np.nan
    y[[30, 31, 150]] = np.nan
    regular = ks.filter(y, theta=0.1, sigma=0.5, obs_var=0.5)
    ks.plot.belief_band(regular, y, ax=axes[0], truth=x, title="filtered belief, regular steps, a gap at 80-109")
    ks.plot.gates(regular, ax=axes[1], title="forget and write gates of the same run")
    axes[0].set_xlabel("")
    save(fig, "gates.png")

    prm = dict(theta=np.array([0.2, 0.5]), sigma=np.array([0.5, 1.0]), obs_var=np.array([1.0, 0.5]))
    x, y = ks.datasets.simulate(T=1000, seed=3, **prm)
    y[np.random.default_rng(0).random(y.shape) < 0.1] = np.nan
    posts = [ks.filter(y, theta=prm["theta"], sigma=prm["sigma"], obs_var=prm["obs_var"] * f) for _, f in CASES]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained", sharey=True)
    for ax, (name, _), p in zip(axes, CASES, posts):
        ks.plot.pit_histogram(p, y, bins=10, ax=ax, title=f"PIT, {name}")
    for ax in axes[1:]:
        ax.set_ylabel("")
    save(fig, "pit_histogram.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained")
    for (name, _), p in zip(CASES, posts):
        ks.plot.reliability(p, y, ax=axes[0], target="obs", label=name, title="reliability of the y predictive")
        ks.plot.reliability(p, x, ax=axes[1], target="state", label=name, title="reliability of the state belief")
    save(fig, "reliability.png")

    fig, axes = plt.subplots(2, 1, figsize=(10, 6.4), layout="constrained", sharex=True)
    for ax, i in zip(axes, (0, 2)):
        ks.plot.nis(posts[i], y, channel=0, ax=ax, window=50, title=f"NIS over time, {CASES[i][0]}")
    axes[0].set_xlabel("")
    save(fig, "nis.png")
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "img"
    for p in main(out):
        print(p)
