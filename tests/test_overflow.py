"""Parameters whose derived quantities overflow the data's dtype are refused, naming the parameter
and the limit (the bounds table, :mod:`kalmanscan.problem.bounds`), on every backend and on each
of ``prepare``'s paths (host values, tensors, the Triton rows kernel); a log-likelihood of ``-inf``
from finite inputs is an error, not a silent result."""

import numpy as np
import pytest
import torch

import kalmanscan as ks
from kalmanscan.ops.filter.triton.param_rows import prepare_static
from kalmanscan.problem.checks import Checks

BACKENDS = ["cpu", "torch", "reference", "triton"]
Y = np.random.default_rng(0).normal(size=(6, 2))
STATIONARY = r"sigma must be small enough that the stationary variance .* fits in {} \(at most {}\)"
NOISE = r"sigma must be small enough that the process noise .* fits in {} \(.*at most {}\)"

CASES = [  # (y, keywords, message)
    (Y, dict(theta=0.1, sigma=1e200, obs_var=1.0), STATIONARY.format("float64", "1.798e\\+308")),
    (Y.astype(np.float32), dict(theta=0.1, sigma=1e20, obs_var=1.0), STATIONARY.format("float32", "3.403e\\+38")),
    (Y, dict(theta=1e10, sigma=1e160, obs_var=1.0, init_var=1.0), NOISE.format("float64", "1.798e\\+308")),
    (Y.astype(np.float32), dict(theta=0.1, sigma=1e20, obs_var=1.0, init_var=1.0),
     NOISE.format("float32", "3.403e\\+38")),
    (Y.astype(np.float32), dict(theta=0.1, sigma=1.0, obs_var=1e300, init_var=1e300),
     r"obs_var must fit in float32, y's dtype \(magnitude at most 3.403e\+38\)"),
    (Y.astype(np.float32), dict(theta=0.1, sigma=1.0, obs_var=1.0, init_var=1e300),
     r"init_var must fit in float32, y's dtype \(magnitude at most 3.403e\+38\)"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("y, kw, message", CASES)
def test_overflowing_parameters_are_refused(backend, y, kw, message):
    with pytest.raises(ValueError, match=message):
        ks.filter(y, backend=backend, **kw)


@pytest.mark.parametrize("y, kw, message", CASES)
def test_refused_as_tensors_too(y, kw, message):
    """Parameters as tensors (the torch path of ``prepare``; per step, and one requiring a gradient)."""
    y_t = torch.tensor(y)
    dtype = y_t.dtype
    given = {k: torch.full(y.shape, v, dtype=torch.float64) if k == "theta" else v for k, v in kw.items()}
    given["sigma"] = torch.tensor(kw["sigma"], dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=message.replace("float64", str(dtype).removeprefix("torch."))):
        ks.filter(y_t, backend="torch", **given)


@pytest.mark.parametrize("y, kw, message", [c for c in CASES if "must fit in" not in c[2]])
def test_refused_by_the_rows_kernel(y, kw, message):
    """The Triton rows kernel (static parameters given as device tensors) reads the same table."""
    y_t = torch.tensor(y)
    values = dict(mean=0.0, h=1.0, dt=1.0, init_mean=None, init_var=None)
    values.update({k: torch.tensor(v, dtype=y_t.dtype) for k, v in kw.items()})
    checks = Checks()
    prepare_static(y_t, values, checks, True, y_t.dtype)
    with pytest.raises(ValueError, match=message):
        checks.decide()


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_but_representable_values_are_kept(backend):
    """Values whose results fit (the variance near 1e300 in float64) are filtered, finite."""
    post = ks.filter(Y * 1e150, theta=0.1, sigma=0.5e150, obs_var=1e300, backend=backend)
    assert np.isfinite(post.mean).all() and np.isfinite(post.var).all() and np.isfinite(post.loglik).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", ["host", "tensor"])
def test_minus_inf_log_likelihood_from_finite_inputs_is_an_error(backend, params):
    y = Y * 1e300  # each observation 1e300 standard deviations from its prediction: -1e600 / 2
    kw = dict(theta=0.1, sigma=1.0, obs_var=1.0)
    if params == "tensor":
        y = torch.tensor(y)
        kw["theta"] = torch.full(y.shape, 0.1, dtype=torch.float64)
    with pytest.raises(ValueError, match="log-likelihood of -inf"):
        ks.filter(y, backend=backend, **kw)
    with pytest.raises(ValueError, match="log-likelihood of -inf"):
        ks.smooth(y, backend=backend, **kw)
    assert np.all(np.isneginf(np.asarray(ks.filter(y, backend=backend, check_finite=False, **kw).loglik)))
