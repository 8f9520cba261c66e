"""The fused RTS smoother (``kernels/filter/rts.py`` under TRITON_INTERPRET=1) against the float64
sequential smoother and the torch reverse scans: odd lengths, many stretches and carry chunks,
static and per-step parameters, NaN-poisoned outputs."""


import numpy as np
import pytest
import torch
from helpers import FLOAT32_BOUND, posterior_error, problem_tensors, random_problem

import kalmanscan as ks
from kalmanscan import fused
from kalmanscan.fused_smooth import rts_triton
from kalmanscan.smooth import rts_torch

@pytest.fixture(params=["one", "many"])
def rts_stretches(request, monkeypatch):
    """One stretch, or stretches of 4 steps with the carry scan in chunks of 4 stretches."""
    if request.param == "many":
        monkeypatch.setattr(fused, "MIN_STRETCH", 4)
        monkeypatch.setattr(fused, "TARGET_LANES", 1 << 30)
        monkeypatch.setattr(fused, "CARRY_CHUNK", 4)
    return request.param


@pytest.mark.parametrize("T", [1, 2, 63, 201])
@pytest.mark.parametrize("per_step,times", [(False, False), (True, True)])
def test_fused_smoother_equals_reference(T, per_step, times, rts_stretches, poisoned):
    rng = np.random.default_rng(900 + T + 10 * per_step)
    y, kw = random_problem(rng, T, C=3, batch=(2,), per_step=per_step, times=times, missing=0.15,
                           offset=20.0)
    ref = ks.smooth(y, backend="reference", **kw)
    out = ks.smooth(torch.tensor(y), backend="triton", **problem_tensors(kw))
    err, errs = posterior_error(out, ref, fields=("mean", "var", "precision"))
    assert err < 1e-10, errs
    out32 = ks.smooth(torch.tensor(y, dtype=torch.float32), backend="triton", **problem_tensors(kw, torch.float32))
    err, errs = posterior_error(out32, ref, fields=("mean", "var", "precision"))
    assert err < FLOAT32_BOUND, errs


def test_rts_kernels_equal_torch_scans_on_arbitrary_inputs(rts_stretches, poisoned):
    """The kernels against :func:`rts_torch` on random positive variances and means (not a filter's
    output), with broadcast static decay and noise and a per-step mean parameter."""
    g = torch.Generator().manual_seed(3)
    B, T, C = 2, 37, 5
    f = {"mean": torch.randn(B, T, C, generator=g, dtype=torch.float64),
         "var": 0.1 + torch.rand(B, T, C, generator=g, dtype=torch.float64),
         "pred_mean": torch.randn(B, T, C, generator=g, dtype=torch.float64),
         "pred_var": 1.0 + torch.rand(B, T, C, generator=g, dtype=torch.float64),
         "decay": (0.5 + 0.5 * torch.rand(1, 1, C, generator=g, dtype=torch.float64)).expand(B, T, C),
         "noise": (0.1 + torch.rand(1, 1, C, generator=g, dtype=torch.float64)).expand(B, T, C)}
    m = torch.randn(1, T, 1, generator=g, dtype=torch.float64).expand(B, T, C)
    mean_s, var_s, prec_s = rts_triton(f, m)
    want_mean, want_var = rts_torch(f, m)
    torch.testing.assert_close(mean_s, want_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var_s, want_var, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(prec_s, 1.0 / want_var, rtol=1e-12, atol=1e-12)


def test_smoother_gradients_still_flow_on_triton():
    """With gradients the smoother's scans run in torch (autograd through the triton filter)."""
    rng = np.random.default_rng(8)
    y, kw = random_problem(rng, 30, C=1, per_step=False)
    theta = torch.tensor(kw.pop("theta"), requires_grad=True)
    post = ks.smooth(torch.tensor(y), backend="triton", theta=theta, **problem_tensors(kw))
    (g,) = torch.autograd.grad(post.mean.sum() + post.var.sum(), [theta])
    assert torch.isfinite(g).all() and float(g.abs().sum()) > 0
