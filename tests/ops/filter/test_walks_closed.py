"""The walks' closed-form aggregate (``FilterConfig.walk_closed``): complete stretches of series with
static parameters sum their information in Horner form instead of composing seven-number maps
(docs/math.md §10), against the float64 reference and the composed branch.

Eight channels and programs of eight lanes, so each program is one stretch: the first (step 0 has
no transition) and a partial last one compose, the others take the closed form up to the first
chunk with a missing value. The interpreter counts which branch each chunk took."""

import importlib
import os

import numpy as np
import pytest
import torch
from helpers import FLOAT32_BOUND, KERNEL_DEVICE, array_tensors, config, max_rel_error, posterior_error, triton_filter

import kalmanscan as ks
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton import backend as triton

walks_closed = importlib.import_module("kalmanscan.kernels.filter.walks_closed")

THETA_DT = np.array([1e-8, 3e-5, 1e-4, 0.3, 30.0, 1e3])
OBS_VAR = np.array([1e-8, 1e-3, 1.0, 1e4, 1e8, 1e-5, 10.0, 1e6])
MOMENTS = ("var", "precision", "pred_var", "pred_precision", "pred_obs_var", "mean", "pred_mean", "logliks")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def walks(stretch, chunk=4, closed=True):
    return config(stretch=stretch, closed_chunk=chunk, small_c_block=8, walk_closed=closed)


@pytest.fixture
def chunks(monkeypatch):
    """The chunks summed in closed form, by branch (``{"head": n, "tail": n}``), and the stretches
    whose map came in closed form (``"maps"``), counted under the interpreter."""
    count = {"head": 0, "tail": 0, "maps": 0}
    if INTERPRETED:
        chunk, agg7 = walks_closed.closed_chunk, walks_closed.closed_agg7

        def counted_chunk(*args):
            count["head" if args[-2] else "tail"] += 1
            return chunk(*args)

        def counted_agg7(s1, s2, done, *rest):
            count["maps"] += int(done > 0)
            return agg7(s1, s2, done, *rest)

        monkeypatch.setattr(walks_closed, "closed_chunk", counted_chunk)
        monkeypatch.setattr(walks_closed, "closed_agg7", counted_agg7)
    return count


def extreme_problem(dtype, init_var, T, missing=0.0, theta_dt=THETA_DT, seed=5):
    """The extreme matrix: ``theta dt`` along the batch, ``obs_var`` along the channels."""
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(len(theta_dt), T, len(OBS_VAR))) * np.sqrt(OBS_VAR) + 0.3
    y[rng.random(y.shape) < missing] = np.nan
    kw = dict(theta=(theta_dt / 0.7)[:, None, None], sigma=2.0, obs_var=OBS_VAR, dt=0.7, mean=0.3, h=1.5,
              init_var=init_var)
    return y, kw, prepare(torch.tensor(y, dtype=dtype, device=KERNEL_DEVICE), **array_tensors(kw, dtype))


def errors(out, ref):
    return posterior_error(out, ref, MOMENTS)[1]


@pytest.mark.parametrize("init_var", [1e-6, 1e6])
def test_extreme_parameters_float32(init_var, chunks):
    """Every moment within :data:`FLOAT32_BOUND` of the float64 reference: ``T = 49`` in stretches of
    8 steps, five of seven in closed form (the walks' own extreme test's horizon)."""
    y, kw, p = extreme_problem(torch.float32, init_var, T=49)
    ref = ks.filter(y, backend="reference", **kw)
    errs = errors(triton_filter(p, walks(8)), ref)
    assert max(errs.values()) < FLOAT32_BOUND, errs
    if INTERPRETED:  # at theta dt = 1e3 the decay underflows to 0: no closed form
        assert chunks["maps"] == 5 * (len(THETA_DT) - 1)
        assert chunks["head"] > 0 and chunks["tail"] > 0


@pytest.mark.slow  # about 5 s: the tiles' composed branch keeps a quick case (test_tiles_closed)
def test_float64_equals_the_composed_branch(chunks):
    """``T = 99`` in stretches of 16, chunks of 4: head and tail chunks, within ``1e-12`` of the
    composed branch on every moment (the rows whose decay is neither 1 nor 0 in float32, for time;
    a stretch's map does not depend on the state it starts from, so one initial variance)."""
    _, _, p = extreme_problem(torch.float64, 1e-6, T=99, theta_dt=THETA_DT[1:5])
    closed, composed = triton_filter(p, walks(16)), triton_filter(p, walks(16, closed=False))
    for k in MOMENTS:
        assert max_rel_error(getattr(closed, k), getattr(composed, k)) < 1e-12, k
    if INTERPRETED:
        assert chunks["maps"] == 5 * 4
        assert chunks["head"] > 0 and chunks["tail"] > 0


def test_a_gap_stops_the_closed_form_at_its_chunk(chunks):
    """A missing value at step 9 of stretch 2 (chunks of 4): that stretch sums two chunks in closed
    form and composes from step 8; stretch 4's gap at its first step leaves it composed whole."""
    y, kw, _ = extreme_problem(torch.float32, 1.0, T=96, theta_dt=THETA_DT[2:4])
    y[:, 32 + 9, 3] = np.nan
    y[:, 64, 0] = np.nan
    t = array_tensors(kw, torch.float32)
    out = triton_filter(prepare(torch.tensor(y, dtype=torch.float32, device=KERNEL_DEVICE), **t), walks(16))
    errs = errors(out, ks.filter(y, backend="reference", **kw))
    assert max(errs.values()) < FLOAT32_BOUND, errs
    if INTERPRETED:  # stretches 1, 2, 3 and 5 of both batch rows; 4 + 3 + 4 + 4 summed chunks and the two refused
        assert chunks["maps"] == 2 * 4
        assert chunks["head"] + chunks["tail"] == 2 * (4 + 3 + 1 + 4 + 4)


@pytest.mark.parametrize("T", [1, 63, 16 * 5, 16 * 5 + 3])
def test_stretch_boundaries_and_every_field(T, poisoned):
    """Odd lengths, several stretches, every posterior field written (buffers start as NaN), the
    initial precision above and below the fixed point in two batch rows, a non-zero mean."""
    rng = np.random.default_rng(T)
    y = rng.normal(size=(2, T, 8)) + 1.0
    kw = dict(theta=0.05, sigma=0.4, obs_var=np.linspace(0.5, 4.0, 8), mean=-0.2, h=0.8,
              init_var=np.array([[[1e-3]], [[50.0]]]))
    ref = ks.filter(y, backend="reference", **kw)
    p = prepare(torch.tensor(y, dtype=torch.float64, device=KERNEL_DEVICE),
                **array_tensors(kw))
    out = triton_filter(p, walks(16))
    for k in MOMENTS + ("pred_obs_mean",):
        assert max_rel_error(getattr(out, k), getattr(ref, k)) < 1e-10, k
    assert abs(float(out.loglik.sum()) - float(ref.loglik.sum())) < 1e-9 * abs(float(ref.loglik.sum()))


@pytest.mark.slow  # about 3.4 s
def test_wide_programs_and_an_inf_in_y(chunks):
    """128 lanes a program (the default block) over 160 channels, programs across two stretches;
    ``y``'s inf check (the sum of the stretch products' information row) still sees an inf in a
    stretch taken in closed form."""
    rng = np.random.default_rng(2)
    y = rng.normal(size=(70, 160))
    kw = dict(theta=0.2, sigma=1.0, obs_var=0.5)
    ref = ks.filter(y, backend="reference", **kw)
    cfg = config(stretch=16, closed_chunk=4)
    p = prepare(torch.tensor(y, device=KERNEL_DEVICE), **kw)
    out = triton_filter(p, cfg)
    for k in MOMENTS:
        assert max_rel_error(getattr(out, k), getattr(ref, k)) < 1e-10, k
    if INTERPRETED:  # programs 2 to 4 of 7 (lanes 256-639: stretches 1 to 3)
        assert chunks["maps"] == 3
    views, init = triton.kernel_views(p), triton.initial_state(p)
    views["y"] = triton.flat(torch.tensor(np.where(np.arange(70)[:, None] * 160 + np.arange(160) == 40 * 160 + 10,
                                                   np.inf, y), device=KERNEL_DEVICE), p.shape)
    checked = triton.filter_forward(views, init, posterior=("mean", "var"), config=cfg, y_check=True)
    assert not np.isfinite(float(checked["y_check"].read()))


@pytest.mark.gpu
@pytest.mark.parametrize("missing", [0.0, 0.001])
def test_compiled_closed_walks_on_cuda(missing):
    """The compiled kernels at the default launch (64 stretches of 64 steps, 128 lanes a program,
    chunks of 16), float32 against the float64 reference, no value or a few missing (the stretches
    with a gap compose from their chunk)."""
    rng = np.random.default_rng(7)
    y = rng.normal(size=(4096, 256)) + 0.5
    y[rng.random(y.shape) < missing] = np.nan
    kw = dict(theta=rng.uniform(0.01, 1.0, 256), sigma=rng.uniform(0.1, 2.0, 256),
              obs_var=rng.uniform(0.01, 10.0, 256), mean=0.5)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y, dtype=torch.float32, device="cuda"), backend="triton",
                    **array_tensors(kw, torch.float32, "cuda"))
    errs = errors(out, ref)
    assert max(errs.values()) < FLOAT32_BOUND, errs
