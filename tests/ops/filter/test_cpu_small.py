"""The cpu backend's path for small float64 work (kalmanscan.ops.filter.cpu.small: the loops'
operations in Python floats and NumPy): the compiled loops' bits, field for field, filter and
smoother, over the features of the filter (static and per-step parameters, irregular times, gaps,
diffuse priors, no process noise with the decay underflowing, the Taylor branch of the
discretisation, batch dimensions, the ends of the scale sweep, a continued stream, gradients),
decided by size and dtype alone."""

import numpy as np
import pytest
import torch

import kalmanscan as ks
from helpers import random_problem
from kalmanscan.ops.filter.cpu import small
from kalmanscan.problem.problem import OUTPUTS
from kalmanscan.tuning import tuned

COMPILED, NUMPY = dict(numpy_work=0), dict(numpy_work=1 << 30)


def _cases():
    rng = np.random.default_rng(58)
    for T, per_step, times in ((1, False, False), (63, True, True), (200, False, False), (41, True, False)):
        yield random_problem(rng, T, per_step=per_step, times=times, missing=0.2, offset=3.0)
    y = rng.normal(size=(30, 3))
    y[:4, 1] = np.nan
    yield y, dict(theta=np.array([1e3, 0.5, 1e-7]), sigma=np.array([0.0, 1.0, 0.3]), obs_var=0.7,
                  init_var=np.array([1.0, np.inf, 2.0]))
    yield y[None].repeat(2, 0), dict(theta=0.0, sigma=0.4, obs_var=rng.uniform(0.1, 1, (2, 30, 3)), init_var=3.0,
                                     dt=rng.uniform(1e-7, 1e-3, (30, 1)))
    for c in (1e-150, 1e150):  # the scale sweep's ends (tests/test_scale.py)
        yield y * c, dict(theta=np.array([0.1, 2.0, 1e-3]), sigma=0.5 * c, obs_var=0.3 * c * c, mean=0.2 * c)


def _alike(read):
    """``read()`` (a list of arrays) on the compiled loops and in Python floats: equal bits."""
    runs = []
    for knobs in (COMPILED, NUMPY):
        with tuned(**knobs):
            runs.append(read())
    for a, b in zip(*runs):
        np.testing.assert_array_equal(b, a)
        assert np.asarray(b).dtype == np.float64


@pytest.mark.parametrize("smooth", [False, True], ids=["filter", "smooth"])
@pytest.mark.parametrize("case", range(8))
def test_numpy_steps_give_the_compiled_loops_bits(case, smooth):
    y, kw = list(_cases())[case]
    fields = [k for k in OUTPUTS if k != "missing"]
    _alike(lambda: [getattr((ks.smooth if smooth else ks.filter)(y, **kw), k) for k in fields])


def test_continued_stream_and_gradients_alike():
    rng = np.random.default_rng(7)
    y, kw = random_problem(rng, 40, C=2, batch=(), missing=0.2)
    rest = {k: v for k, v in kw.items() if k not in ("init_mean", "init_var")}

    def read():
        later = ks.filter(y[15:], **rest, state=ks.filter(y[:15], **kw))
        theta = torch.tensor(kw["theta"], requires_grad=True)
        post = ks.filter(torch.tensor(y), **dict(kw, theta=theta))
        post.loglik.sum().backward()
        return [later.mean, later.var, later.loglik, post.mean.detach().numpy(), theta.grad.numpy()]

    _alike(read)


def test_decided_by_size_and_dtype():
    with tuned(numpy_work=100):
        assert small.small(np.float64, (2, 10, 5))
        assert not small.small(np.float64, (2, 10, 6))
        assert not small.small(np.float32, (1, 2))  # float32: the compiled loops compute in float32
    assert small.small(np.float64, (1000, 4)) and not small.small(np.float64, (1000, 5))  # the default

