"""The tiles' closed-form branch (``FilterConfig.tile_closed``): complete stretches of a series with
static parameters, their merged map from two weighted sums and their states from the closed-form
power (docs/math.md §9, §10), against the float64 reference and the composed branch.

Tiles of 16 steps in at most 8 stretches: ``T = 259`` is 17 tiles, 6 stretches of 3 tiles; the
first (step 0 has no transition) and the last (partial) compose their steps, the four between take
the closed form unless a value is missing. The float32 matrix runs ``T = 49`` in stretches of one
tile of 8 steps (7 stretches, 5 in closed form): the horizon of the walks' own extreme test, since
over longer ones both branches' float32 errors grow with the number of steps alike (at ``T = 259``,
``theta dt = 1e-4`` and ``obs_var = 1e8``: 6-8e-6 for either, from a vague or a sharp start). The
interpreter's time grows with the number of programs: the float64 comparison runs the slowly
converging third of the matrix."""

import importlib
import os

import numpy as np
import pytest
import torch
from helpers import FLOAT32_BOUND, KERNEL_DEVICE, array_tensors, config, max_rel_error, posterior_error, triton_filter

import kalmanscan as ks
from kalmanscan.problem.prepare import prepare

tiles = importlib.import_module("kalmanscan.kernels.filter.tiles")

CLOSED = config(tile=16, tile_stretches=8, tile_row=4)
COMPOSED = config(tile=16, tile_stretches=8, tile_row=4, tile_closed=False)
FOUR, FOUR_COMPOSED = config(tile=16, tile_stretches=4, tile_row=4), config(tile=16, tile_stretches=4, tile_row=4,
                                                                          tile_closed=False)
SHORT = config(tile=8, tile_stretches=8, tile_row=4)
THETA_DT = np.array([1e-8, 3e-5, 1e-4, 0.3, 30.0, 1e3])
OBS_VAR = np.array([1e-8, 1e-3, 1.0, 1e4, 1e8])
MOMENTS = ("var", "precision", "pred_var", "pred_precision", "pred_obs_var", "mean", "pred_mean", "logliks")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def closed_stretches(monkeypatch):
    """How many stretches took the closed form (counted under the interpreter, else ``None``)."""
    count = [0]
    if INTERPRETED:
        original = tiles.closed_agg7

        def counted(*args):
            count[0] += 1
            return original(*args)

        monkeypatch.setattr(tiles, "closed_agg7", counted)
    return count


def extreme_problem(dtype, init_var, missing=0.0, T=259, theta_dt=THETA_DT):
    """One series per (theta dt, obs_var) pair of the extreme matrix, as the batch axis."""
    rng = np.random.default_rng(11)
    theta = np.repeat(theta_dt / 0.7, len(OBS_VAR))
    obs_var = np.tile(OBS_VAR, len(theta_dt))
    y = rng.normal(size=(len(theta), T, 1)) * np.sqrt(obs_var)[:, None, None] + 0.3
    y[rng.random(y.shape) < missing] = np.nan
    kw = dict(theta=theta[:, None, None], sigma=2.0, obs_var=obs_var[:, None, None], dt=0.7, mean=0.3,
              h=1.5, init_var=init_var)
    return y, kw, prepare(torch.tensor(y, dtype=dtype, device=KERNEL_DEVICE), **array_tensors(kw, dtype))


def errors(out, ref):
    return posterior_error(out, ref, MOMENTS)[1]


@pytest.mark.parametrize("init_var", [1e-6, 1e6])
def test_extreme_parameters_float32(init_var, closed_stretches):
    """Every moment within :data:`FLOAT32_BOUND` of the float64 reference (the composed branch is
    within it too on this matrix: measured when this test was written, not repeated for time)."""
    y, kw, p = extreme_problem(torch.float32, init_var, T=49)
    ref = ks.filter(y, backend="reference", **kw)
    closed = errors(triton_filter(p, SHORT), ref)
    assert max(closed.values()) < FLOAT32_BOUND, closed
    if INTERPRETED:  # where theta dt = 1e-8 rounds the decay to 1 with no noise left, no closed form
        assert closed_stretches[0] >= 5 * (len(THETA_DT) - 1) * len(OBS_VAR)


@pytest.mark.parametrize("init_var", [1e-6, 1e6])
def test_float64_equals_the_composed_branch(init_var, closed_stretches):
    """The slowly converging rows of the matrix (theta dt 3e-5 to 0.3): T = 147 in 4 stretches of 3
    tiles, the middle two in closed form."""
    _, _, p = extreme_problem(torch.float64, init_var, T=147, theta_dt=THETA_DT[1:4])
    closed, composed = triton_filter(p, FOUR), triton_filter(p, FOUR_COMPOSED)
    for k in MOMENTS:
        assert max_rel_error(getattr(closed, k), getattr(composed, k)) < 1e-12, k
    if INTERPRETED:
        assert closed_stretches[0] == 2 * 3 * len(OBS_VAR)


def test_a_stretch_with_a_missing_value_composes_its_steps(closed_stretches):
    y, kw, _ = extreme_problem(torch.float32, 1.0)
    y = y[12:14].copy()  # theta dt = 1e-4, obs_var 1 and 1e4
    y[:, 100, 0] = np.nan   # stretch 2 (steps 96-143) of both series
    kw = {k: v[12:14] if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    t = array_tensors(kw, torch.float32)
    out = triton_filter(prepare(torch.tensor(y, dtype=torch.float32, device=KERNEL_DEVICE), **t), CLOSED)
    ref = ks.filter(y, backend="reference", **kw)
    errs = errors(out, ref)
    assert max(errs.values()) < FLOAT32_BOUND, errs
    if INTERPRETED:
        assert closed_stretches[0] == 2 * 3  # stretches 1, 3 and 4 of each series


@pytest.mark.parametrize("T", [48 * 2, 48 * 3 + 1, 16 * 8 * 3])
def test_stretch_boundaries_and_every_field(T, poisoned):
    """Stretch and tile boundaries (the closed form restarted from each stretch's carried state, the
    mean carried across tiles), every posterior field written, the initial precision above and below
    the fixed point in two batch rows."""
    rng = np.random.default_rng(T)
    y = rng.normal(size=(2, T, 1))
    kw = dict(theta=0.05, sigma=0.4, obs_var=2.0, mean=-0.2, h=0.8, init_var=np.array([[1e-3], [50.0]]))
    ref = ks.filter(y, backend="reference", **kw)
    p = prepare(torch.tensor(y, dtype=torch.float64, device=KERNEL_DEVICE),
                **array_tensors(kw))
    out = triton_filter(p, CLOSED)
    for k in MOMENTS + ("pred_obs_mean",):
        assert max_rel_error(getattr(out, k), getattr(ref, k)) < 1e-10, k
