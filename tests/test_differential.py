"""Randomized differential test of the filter and the smoother: every backend against the
60-digit oracle (:mod:`oracle`) over the feature matrix.

Each example draws the features with hypothesis (shapes, which parameters are per step, irregular
times, gaps, finite or diffuse or stationary priors, channels without process noise (``sigma =
0``), decays that underflow, a stream continued at a split) and the values from a seeded NumPy
generator. The cpu, torch and reference backends then filter and smooth it, in one call or as two
chunks (the second given ``state=`` the first), and every field is compared with the oracle's:

- variances elementwise, to ``RTOL`` relative (absolutely below the normal range, where float64
  itself keeps no relative accuracy);
- filtered and predicted means to ``RTOL`` of the largest mean, log-likelihoods to ``RTOL`` of
  their magnitude plus 1;
- smoothed means to ``RTOL`` of their forward error bound ``E_t = |mean_t| + J_t (|pred_mean_{t+1}|
  + E_{t+1})`` (``J_t`` the oracle's RTS gain): the smoother reads the filter's uncentred means,
  and a gain ``J = 1 / decay`` without process noise magnifies their last digit.

Profiles: CI runs :data:`EXAMPLES` examples per backend, derandomized (a fixed sequence, a few
seconds), and :data:`TRITON_EXAMPLES` on the triton backend through the interpreter (about a
second each; it runs where ``TRITON_INTERPRET=1``, as the suite sets it). For a longer, random
run set ``KALMANSCAN_DIFFERENTIAL_EXAMPLES`` (the triton backend then runs a tenth as many), e.g.::

    KALMANSCAN_DIFFERENTIAL_EXAMPLES=3000 python -m pytest -n 0 -q tests/test_differential.py
"""

from __future__ import annotations

import os

import numpy as np
import oracle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kalmanscan as ks
from kalmanscan.tuning import tuned

EXAMPLES = 25
TRITON_EXAMPLES = 4
LONG = int(os.environ.get("KALMANSCAN_DIFFERENTIAL_EXAMPLES", "0"))
RTOL = 1e-11
BACKENDS = ("reference", "cpu", "torch")
TINY = np.finfo(np.float64).tiny


def profile(examples: int):
    """``examples`` derandomized examples, or the long random profile (module docstring)."""
    return settings(max_examples=examples, derandomize=not LONG, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    """``(y, kw, split)``: a filter problem of NumPy float64 arrays for ``ks.filter`` and the step
    at which a stream continues (``None``: one call)."""
    T = draw(st.sampled_from([1, 2, 3, 5, 8, 13]))
    C = draw(st.integers(1, 3))
    batch = draw(st.sampled_from([(), (2,)]))
    per_step = draw(st.sets(st.sampled_from(["theta", "sigma", "obs_var", "mean", "h"])))
    irregular = draw(st.booleans())
    gaps = draw(st.sampled_from([0.0, 0.3, 0.7]))
    no_noise = draw(st.lists(st.booleans(), min_size=C, max_size=C))
    walk = draw(st.lists(st.booleans(), min_size=C, max_size=C))
    prior = draw(st.sampled_from(["finite", "diffuse", "stationary"]))
    split = draw(st.integers(1, T - 1)) if T > 1 and draw(st.booleans()) else None
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    shape = batch + (T, C)

    def param(name, lo, hi, log=False):
        pshape = shape if name in per_step else (C,)
        x = rng.uniform(np.log10(lo), np.log10(hi), pshape) if log else rng.uniform(lo, hi, pshape)
        return 10.0**x if log else x

    theta = np.where(walk, 0.0, param("theta", 1e-3, 1e3, log=True))
    sigma = np.where(no_noise, 0.0, param("sigma", 1e-2, 1e2, log=True))
    kw = dict(theta=theta, sigma=sigma, obs_var=param("obs_var", 1e-3, 1e3, log=True),
              mean=param("mean", -3.0, 3.0), h=param("h", 0.5, 2.0) * rng.choice([-1.0, 1.0], C))
    if irregular:
        kw["times"] = np.cumsum(10.0 ** rng.uniform(-2, 0.5, T)) + rng.normal()
    else:
        kw["dt"] = 10.0 ** rng.uniform(-2, 0.5)
    cshape = batch + (C,)
    kw["init_mean"] = rng.normal(size=cshape)
    finite = 10.0 ** rng.uniform(-2, 2, cshape)
    if prior == "diffuse":  # some channels diffuse, their transitions kept invertible (decay > 0)
        diffuse = rng.random(cshape) < 0.6
        kw["init_var"] = np.where(diffuse, np.inf, finite)
        kw["theta"] = np.minimum(kw["theta"], 10.0)
    elif prior == "stationary" and not (any(walk) or any(no_noise)):
        del kw["init_mean"]
    else:
        kw["init_var"] = finite
    y = kw["mean"] + rng.normal(size=shape) * (1.0 + np.sqrt(kw["obs_var"]))
    y[rng.random(shape) < gaps] = np.nan
    return y, kw, split


def truth(y, kw) -> dict:
    """The oracle's filter and smoother of ``(y, kw)``, given float64 ``decay, noise`` as the
    library discretises them."""
    T = y.shape[-2]
    dt = kw["dt"] if "times" not in kw else np.concatenate([[1.0], np.diff(kw["times"])])[:, None]
    decay, noise = ks.ou.discretize(kw["theta"], kw["sigma"], dt)
    mean = np.broadcast_to(kw["mean"], y.shape)
    init_mean = kw.get("init_mean", mean[..., 0, :])
    init_var = kw.get("init_var")
    if init_var is None:
        init_var = ks.ou.stationary_var(np.broadcast_to(kw["theta"], y.shape)[..., 0, :],
                                        np.broadcast_to(kw["sigma"], y.shape)[..., 0, :])
    assert T == y.shape[-2]
    return oracle.smooth(y, decay, noise, kw["obs_var"], kw["h"], mean, init_mean, init_var)


def chunk(kw: dict, lo: int, hi: int, T: int) -> dict:
    """The keywords of steps ``lo..hi - 1`` (a per-step parameter sliced, the prior dropped for a
    continued chunk)."""
    out = {}
    for k, x in kw.items():
        if k == "times":
            out[k] = x[lo:hi]
        elif k in ("init_mean", "init_var"):
            if lo == 0:
                out[k] = x
        elif np.ndim(x) >= 2 and np.shape(x)[-2] == T:
            out[k] = x[..., lo:hi, :]
        else:
            out[k] = x
    return out


def close(name, actual, expected, scale, bound=None):
    """``|actual - expected| <= RTOL * scale`` elementwise (``scale`` broadcasts), inf where
    ``expected`` is inf; ``bound`` adds an absolute floor."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, (name, a.shape, e.shape)
    inf = np.isinf(e)
    assert np.array_equal(np.isinf(a), inf) and not np.isnan(a).any(), (name, a, e)
    err = np.abs(np.where(inf, 0.0, a - np.where(inf, 0.0, e)))
    limit = RTOL * np.where(inf, 1.0, scale) + (0.0 if bound is None else bound)
    worst = np.unravel_index(np.argmax(err - limit), err.shape)
    assert np.all(err <= limit), (name, worst, a[worst], e[worst])


def check_filter(post, ref: dict, steps: slice):
    for k in ("var", "pred_var"):
        e = ref[k][..., steps, :]
        close(k, getattr(post, k), e, np.abs(e), TINY)
    for k in ("mean", "pred_mean"):
        e = ref[k][..., steps, :]
        close(k, getattr(post, k), e, np.max(np.abs(e), initial=1e-300))
    e = ref["logliks"][..., steps, :]
    close("logliks", post.logliks, e, 1.0 + np.abs(e))


def smoothed_mean_scale(ref: dict, T: int) -> np.ndarray:
    """The forward error bound of the smoothed mean (module docstring), from the oracle's moments."""
    var, pred_var, decay = ref["var"], ref["pred_var"], ref["decay"]
    scale = np.abs(ref["mean"]).copy()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for t in range(T - 2, -1, -1):
            a, v, pv = decay[..., t + 1, :], var[..., t, :], pred_var[..., t + 1, :]
            J = np.where(np.isinf(v), 1.0 / a, np.where(pv > 0, a * v / pv, 0.0))  # inf: a diffuse lead
            scale[..., t, :] += J * (np.abs(ref["pred_mean"][..., t + 1, :]) + scale[..., t + 1, :])
    return scale


def check_smooth(post, ref: dict, steps: slice, scale: np.ndarray):
    e = ref["smooth_var"][..., steps, :]
    close("smoothed var", post.var, e, np.abs(e), TINY)
    close("smoothed mean", post.mean, ref["smooth_mean"][..., steps, :], scale[..., steps, :])


@pytest.mark.parametrize("backend", BACKENDS)
@profile(LONG or EXAMPLES)
@given(problems())
def test_backends_agree_with_the_oracle(backend, problem):
    agree_with_the_oracle(backend, problem)


@profile(LONG or EXAMPLES)
@given(problems())
def test_compiled_loops_agree_with_the_oracle(problem):
    """The cpu backend's compiled loops on these small problems too (the backend runs them in
    Python floats otherwise: kalmanscan.ops.filter.cpu.small)."""
    with tuned(numpy_work=0):
        agree_with_the_oracle("cpu", problem)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels on CPU tensors: the interpreter")
@profile(LONG // 10 or TRITON_EXAMPLES)
@given(problems())
def test_triton_agrees_with_the_oracle(problem):
    agree_with_the_oracle("triton", problem)


def agree_with_the_oracle(backend: str, problem: tuple) -> None:
    """Filter and smooth ``problem`` on ``backend``, in one call or as a continued stream, and
    compare every field with the oracle's (module docstring)."""
    y, kw, split = problem
    T = y.shape[-2]
    whole = truth(y, kw)
    dt = kw["dt"] if "times" not in kw else np.concatenate([[1.0], np.diff(kw["times"])])[:, None]
    whole["decay"] = np.broadcast_to(ks.ou.discretize(kw["theta"], kw["sigma"], dt)[0], y.shape)
    if split is None:
        check_filter(ks.filter(y, backend=backend, **kw), whole, slice(None))
        check_smooth(ks.smooth(y, backend=backend, **kw), whole, slice(None), smoothed_mean_scale(whole, T))
        return
    first = ks.filter(y[..., :split, :], backend=backend, **chunk(kw, 0, split, T))
    later = ks.filter(y[..., split:, :], backend=backend, state=first, **chunk(kw, split, T, T))
    check_filter(first, whole, slice(None, split))
    check_filter(later, whole, slice(split, None))
    close("loglik", first.loglik + later.loglik, whole["loglik"], 1.0 + np.abs(whole["loglik"]))
    smoothed = ks.smooth(y[..., split:, :], backend=backend, state=first, **chunk(kw, split, T, T))
    check_smooth(smoothed, whole, slice(split, None), smoothed_mean_scale(whole, T))
    head = truth(y[..., :split, :], chunk(kw, 0, split, T))
    head["decay"] = whole["decay"][..., :split, :]
    check_smooth(ks.smooth(y[..., :split, :], backend=backend, **chunk(kw, 0, split, T)), head,
                 slice(None), smoothed_mean_scale(head, split))
