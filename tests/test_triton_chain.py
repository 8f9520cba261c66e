"""The single-pass chained forward (``fused.CHAIN``, :mod:`kernels.filter_chain`) under
TRITON_INTERPRET=1 against the float64 reference and the three-kernel forward.

Stretches of 4 steps, so small problems cross many stretch boundaries; ``C = 130`` gives two
channel blocks of 128 lanes (the second nearly empty). The interpreter runs programs one after
another, so every look-back finds its predecessor finished: ``PUBLISH = 3`` publishes the state
after a stretch on every third stretch only, so the others' successors compose aggregates back to
the last published state (or to the initial one), the path a GPU takes when predecessors are
still running.
"""

import numpy as np
import pytest
import torch
from helpers import FLOAT32_BOUND, Launches, forward_views, posterior_error, problem_tensors, random_problem

import kalmanscan as ks
from kalmanscan import fused


@pytest.fixture(params=[1, 3])
def chain(request, monkeypatch):
    """The chained forward on, stretches of 4 steps, publishing every ``param``-th stretch's state;
    yields its counted launches."""
    monkeypatch.setattr(fused, "CHAIN", True)
    monkeypatch.setattr(fused, "CHAIN_STRETCH", 4)
    monkeypatch.setattr(fused, "CHAIN_PUBLISH", request.param)
    launches = Launches(fused.filter_chain_kernel)
    monkeypatch.setattr(fused, "filter_chain_kernel", launches)
    return launches


CASES = [(T, C, per_step, times) for T, C in ((1, 33), (63, 33), (101, 40), (37, 130))
         for per_step, times in ((False, False), (True, True), (True, False))]


@pytest.mark.parametrize("T,C,per_step,times", CASES)
def test_chain_equals_reference_float64(T, C, per_step, times, chain, poisoned):
    rng = np.random.default_rng(300 + T + C + 10 * per_step + times)
    y, kw = random_problem(rng, T, C=C, per_step=per_step, times=times, missing=0.15, offset=10.0)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y), backend="triton", **problem_tensors(kw))
    assert chain.count == 1
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs


@pytest.mark.parametrize("outputs", [("mu",), ("lam", "pred_var"), ("mu", "lam", "pred_mu", "pred_var")])
def test_chain_outputs_equal_three_kernel_forward(outputs, chain, poisoned, monkeypatch):
    """Only the requested outputs are written, and they equal the aggregate-carry-apply forward's
    on the same stretches to float64 rounding."""
    rng = np.random.default_rng(310)
    y, kw = random_problem(rng, 45, C=40, per_step=True, times=True, missing=0.15)
    views, init = forward_views(y, kw)
    got = fused.filter_forward(views, init, outputs=outputs)
    assert chain.count == 1 and set(got) == set(outputs)
    monkeypatch.setattr(fused, "CHAIN", False)
    want = fused.filter_forward(views, init, outputs=outputs, stretch=4)
    for k in outputs:
        assert torch.all(torch.isfinite(got[k]))
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)


def test_chain_float32_within_measured_bound(chain, poisoned):
    rng = np.random.default_rng(320)
    y, kw = random_problem(rng, 301, C=33, offset=100.0)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y, dtype=torch.float32), backend="triton", **problem_tensors(kw, torch.float32))
    assert posterior_error(out, ref)[0] < FLOAT32_BOUND


def test_chain_gradients_equal_torch_autograd(chain):
    """Through autograd (the backward walks from the chained forward's saved outputs)."""
    rng = np.random.default_rng(330)
    y, kw = random_problem(rng, 29, C=33, per_step=True, times=True, missing=0.15)
    grads = {}
    for backend in ("torch", "triton"):
        t = {k: torch.tensor(v, requires_grad=k != "times") for k, v in kw.items()}
        y_t = torch.tensor(y, requires_grad=True)
        post = ks.filter(y_t, backend=backend, **t)
        loss = post.loglik.sum() + (post.mean * post.var).sum()
        names = [k for k in t if k != "times"]
        grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in names])
    for a, b in zip(grads["torch"], grads["triton"]):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
