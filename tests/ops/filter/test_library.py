"""The triton filter as torch.library operators: opcheck on tiny shapes (the kernels under
TRITON_INTERPRET=1 on the CPU), and torch.compile of a function calling ks.filter on CUDA."""

import pytest
import torch
from helpers import KERNEL_DEVICE

import kalmanscan as ks
from kalmanscan.ops.filter.triton import library
from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG


def _args(static: bool, requires_grad: bool):
    g = torch.Generator().manual_seed(0)
    B, T, C = 2, 5, 3
    t = T if not static else 1
    y = torch.randn(B, T, C, dtype=torch.float64, generator=g)
    theta = torch.rand(B, t, C, dtype=torch.float64, generator=g) + 0.2
    sigma = torch.rand(B, t, C, dtype=torch.float64, generator=g) + 0.3
    dt = torch.rand(1, t, C, dtype=torch.float64, generator=g) + 0.5
    obs_var = torch.rand(B, t, C, dtype=torch.float64, generator=g) + 0.4
    mean = torch.randn(1, 1, C, dtype=torch.float64, generator=g)
    h = torch.rand(B, t, 1, dtype=torch.float64, generator=g) + 0.5
    init = torch.stack([torch.rand(B, C, dtype=torch.float64, generator=g) + 0.5,
                        torch.randn(B, C, dtype=torch.float64, generator=g)], 1)
    tensors = [x.to(KERNEL_DEVICE).requires_grad_(requires_grad) for x in (y, theta, sigma, dt, obs_var, mean, h, init)]
    return (*tensors, [B, T, C], DEFAULT_CONFIG.as_ints())


@pytest.mark.parametrize("static", [True, False])
def test_opcheck_forward(static):
    torch.library.opcheck(library.filter_fused, _args(static, requires_grad=True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("static", [True, False])
def test_opcheck_backward(static):
    y, theta, sigma, dt, obs_var, mean, h, init, shape, config = _args(static, requires_grad=False)
    mu, lam, pred_mu, pred_var = library.filter_fused(y, theta, sigma, dt, obs_var, mean, h, init, shape, config)
    g = torch.ones_like(mu)
    torch.library.opcheck(library.filter_fused_backward,
                          (y, theta, sigma, dt, obs_var, mean, h, init, mu, lam, g, None, g, None, shape, config),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("static", [True, False])
def test_opcheck_posterior(static):
    from kalmanscan.ops.filter.triton.backend import posterior_mask

    y, theta, sigma, dt, obs_var, mean, h, init, shape, config = _args(static, requires_grad=False)
    args = (y, theta, sigma, dt, obs_var, mean, h, init, shape, config, posterior_mask(("mean", "var", "logliks")))
    torch.library.opcheck(library.filter_posterior, args, test_utils=("test_schema", "test_faketensor"))
    got = library.filter_posterior(*args)
    assert [tuple(x.shape) for x in got] == [tuple(shape)] * 3


def test_gradients_through_the_operator_match_the_torch_backend():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(7, 2, dtype=torch.float64, generator=g).to(KERNEL_DEVICE)
    theta = torch.tensor([0.3, 0.6], dtype=torch.float64, requires_grad=True, device=KERNEL_DEVICE)
    obs_var = torch.tensor(0.4, dtype=torch.float64, requires_grad=True, device=KERNEL_DEVICE)
    grads = []
    for backend in ("triton", "torch"):
        post = ks.filter(y, theta=theta, sigma=0.7, obs_var=obs_var, backend=backend)
        grads.append(torch.autograd.grad(post.loglik.sum() + post.mean.square().sum(), (theta, obs_var)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_operator_compiles_without_graph_break():
    args = _args(True, requires_grad=True)

    def f(*args):
        mu, lam, pred_mu, pred_var = library.filter_fused(*args)
        return (mu * mu / lam).sum() + pred_var.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    want, got = f(*args), compiled(*args)
    torch.testing.assert_close(got, want)
    tensors = args[:8]
    for a, b in zip(torch.autograd.grad(got, tensors), torch.autograd.grad(want, tensors)):
        torch.testing.assert_close(a, b)


def test_config_round_trips_through_integers():
    assert type(DEFAULT_CONFIG).from_ints(DEFAULT_CONFIG.as_ints()) == DEFAULT_CONFIG


@pytest.mark.gpu
def test_compiled_filter_matches_eager():
    y = torch.randn(2, 300, 16, device="cuda")
    theta = torch.rand(16, device="cuda") + 0.1

    def f(y, theta):
        post = ks.filter(y, theta=theta, sigma=0.5, obs_var=0.3, backend="triton")
        return post.mean, post.var, post.loglik

    compiled = torch.compile(f)  # validation in prepare still breaks the graph; the operator does not
    before = theta.clone()
    got = compiled(y, theta)
    torch.testing.assert_close(theta, before, rtol=0, atol=0)  # nothing the caller passed is written
    for got, want in zip(got, f(y, theta)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    theta.requires_grad_()
    (gc,) = torch.autograd.grad(compiled(y, theta)[2].sum(), theta)
    (ge,) = torch.autograd.grad(f(y, theta)[2].sum(), theta)
    torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-5)
