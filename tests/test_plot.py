"""ks.plot: every plot draws on the Agg backend, returns its Axes and checks its arguments."""

import io
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from scipy import stats  # noqa: E402

import kalmanscan as ks  # noqa: E402
from kalmanscan.datasets import simulate  # noqa: E402

PARAMS = dict(theta=np.array([0.1, 0.5]), sigma=np.array([0.5, 1.0]), obs_var=np.array([0.5, 0.3]))


@pytest.fixture(scope="module")
def run():
    x, y = simulate(T=201, seed=1, **PARAMS)
    y[80:110, 0] = np.nan
    y[[5, 150], 0] = np.nan
    return x, y, ks.filter(y, **PARAMS)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _draws(ax):
    buf = io.BytesIO()
    ax.figure.savefig(buf, format="png", dpi=40)
    return buf.tell() > 0


def test_belief_band_marks_each_missing_stretch(run):
    x, y, post = run
    ax = ks.plot.belief_band(post, y, channel=0, truth=x)
    spans = [p for p in ax.patches if p.get_label() == "missing" or p.get_facecolor()[:3] == pytest.approx((0.6,) * 3)]
    assert len(spans) == 3
    assert _draws(ax)
    fig, ax2 = plt.subplots()
    assert ks.plot.belief_band(post, channel=1, ax=ax2, z=1.0) is ax2
    assert len(ax2.patches) == 0


def test_belief_band_with_smoother_batch_and_torch(run):
    x, y, _ = run
    post = ks.smooth(torch.tensor(np.stack([y, y])), **{k: torch.tensor(v) for k, v in PARAMS.items()})
    ax = ks.plot.belief_band(post, np.stack([y, y]), index=(1,), channel=0, times=np.arange(201) * 0.5)
    assert ax.get_xlim()[1] < 120 and _draws(ax)
    with pytest.raises(ValueError, match="index"):
        ks.plot.belief_band(post)
    with pytest.raises(ValueError, match="channel"):
        ks.plot.belief_band(post, index=(0,), channel=2)
    with pytest.raises(ValueError, match="times"):
        ks.plot.belief_band(post, index=(0,), times=np.arange(3))


def test_pit_histogram_bars_and_uniform_band(run):
    _, y, post = run
    ax = ks.plot.pit_histogram(post, y, bins=8)
    bars = [p for p in ax.patches if p.get_width() == pytest.approx(1 / 8)]
    assert len(bars) == 8
    assert sum(b.get_height() for b in bars) == pytest.approx(8.0)
    n = int(np.isfinite(y).sum())
    lo, hi = stats.binom.interval(0.95, n, 1 / 8)
    band = [p for p in ax.patches if p not in bars][0]
    assert band.get_y() == pytest.approx(lo / (n / 8))
    assert band.get_y() + band.get_height() == pytest.approx(hi / (n / 8))
    one = ks.plot.pit_histogram(post, y, channel=1)
    assert _draws(one)
    with pytest.raises(ValueError, match="bins"):
        ks.plot.pit_histogram(post, y, bins=1)


@pytest.mark.parametrize("target", ["state", "obs"])
def test_reliability_points_and_overlay(run, target):
    x, y, post = run
    ref = x if target == "state" else y
    ax = ks.plot.reliability(post, ref, levels=[0.5, 0.9], target=target, label="right")
    line = ax.get_lines()[-1]
    cov = (ks.diagnostics.coverage if target == "state" else ks.diagnostics.predictive_coverage)(post, ref, [0.5, 0.9])
    np.testing.assert_allclose(line.get_ydata(), cov)
    wrong = ks.filter(y, **{**PARAMS, "obs_var": PARAMS["obs_var"] * 4})
    assert ks.plot.reliability(wrong, ref, ax=ax, target=target, channel=0, label="x4") is ax
    assert len(ax.collections) == 1 and _draws(ax)
    with pytest.raises(ValueError, match="target"):
        ks.plot.reliability(post, ref, target="y")


def test_nis_and_gates(run):
    _, y, post = run
    ax = ks.plot.nis(post, y, channel=0, window=20)
    assert ax.get_yscale() == "log" and _draws(ax)
    assert any("running mean" in (line.get_label() or "") for line in ax.get_lines())
    ax = ks.plot.gates(post, channel=0)
    forget, write = (line.get_ydata() for line in ax.get_lines()[:2])
    np.testing.assert_allclose(write[80:110], 0.0)
    assert np.all(np.diff(forget[81:110]) >= 0)
    assert _draws(ax)
    with pytest.raises(ValueError, match="window"):
        ks.plot.nis(post, y, window=0)


def test_docs_figure_script_writes_every_png(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
    try:
        import make_figures
    finally:
        sys.path.pop(0)
    written = make_figures.main(tmp_path, dpi=40)
    assert sorted(p.name for p in written) == sorted(
        ["belief_band.png", "gates.png", "pit_histogram.png", "reliability.png", "nis.png"])
    assert all(p.stat().st_size > 2_000 for p in written)
