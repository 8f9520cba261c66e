"""ks.smooth: the reverse-scan RTS smoother against the sequential float64 smoother."""

import numpy as np
import pytest
import torch
from helpers import max_rel_error, on_device, random_problem, rel_error

import kalmanscan as ks


@pytest.mark.parametrize("T", [1, 2, 63, 1000])
@pytest.mark.parametrize("per_step, times", [(False, False), (True, True)])
def test_torch_smoother_equals_reference(T, per_step, times):
    rng = np.random.default_rng(T + 7 * per_step)
    y, kw = random_problem(rng, T, per_step=per_step, times=times)
    ref = ks.smooth(y, backend="reference", **kw)
    out = ks.smooth(on_device(y), backend="torch", **kw)
    assert max_rel_error(out.mean, ref.mean) < 1e-10
    assert rel_error(out.var, ref.var) < 1e-10
    assert rel_error(out.precision, ref.precision) < 1e-10
    assert max_rel_error(out.filtered.mean, ref.filtered.mean) < 1e-10
    torch.testing.assert_close(out.logliks, out.filtered.logliks, rtol=0, atol=0)


def test_smoothing_only_reduces_variance_and_ends_at_the_filter():
    rng = np.random.default_rng(3)
    y, kw = random_problem(rng, 200)
    post = ks.smooth(y, backend="torch", **kw)
    assert np.all(post.var <= post.filtered.var * (1 + 1e-12))
    np.testing.assert_allclose(post.mean[..., -1, :], post.filtered.mean[..., -1, :], rtol=1e-14)


def test_smoother_float32_and_torch_out():
    rng = np.random.default_rng(4)
    y, kw = random_problem(rng, 300, times=True)
    ref = ks.smooth(y, backend="reference", **kw)
    out = ks.smooth(on_device(y, torch.float32), backend="torch", **kw)
    assert out.mean.dtype == torch.float32 and out.filtered.mean.dtype == torch.float32
    assert max_rel_error(out.mean, ref.mean) < 4e-6
    assert rel_error(out.var, ref.var) < 4e-6


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_no_process_noise(backend):
    """sigma = 0: short series smooth exactly (gain 1/decay), and so do long ones: once the
    filtered variance underflows to 0 the gain is its limit 0 (ops.filter.torch.rts_gains), so the
    backward recursion stays in range (2000 steps: within 2e-13 of the 60-digit oracle,
    tests/test_edge_cases.py)."""
    rng = np.random.default_rng(8)
    kw = dict(theta=np.array([1.0, 0.3]), sigma=0.0, obs_var=0.7, init_var=2.0)
    y = rng.normal(size=(20, 2))
    sm = ks.smooth(y, backend=backend, **kw)
    ref = ks.smooth(y, backend="reference", **kw)
    assert np.isfinite(np.asarray(sm.mean)).all() and np.isfinite(np.asarray(sm.var)).all()
    np.testing.assert_allclose(np.asarray(sm.mean), np.asarray(ref.mean), rtol=1e-10, atol=1e-12)
    y = rng.normal(size=(2000, 2))
    long, ref = (ks.smooth(y, backend=b, **kw) for b in (backend, "reference"))
    assert np.isfinite(np.asarray(long.mean)).all() and np.isfinite(np.asarray(long.var)).all()
    np.testing.assert_allclose(np.asarray(long.mean), np.asarray(ref.mean), rtol=1e-10, atol=1e-12)
