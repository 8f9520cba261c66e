"""OU discretisation against an independent Van Loan matrix exponential, and its inverse."""

import numpy as np
import pytest
import torch
from scipy.linalg import expm

from kalmanscan.model import ou


def van_loan(theta, sigma, dt):
    """(decay, noise) of dx = -theta x dt + sigma dW over dt via the Van Loan block exponential."""
    F = np.array([[-theta * dt, sigma**2 * dt], [0.0, theta * dt]])
    E = expm(F)
    decay = E[1, 1] ** -1
    return decay, E[0, 1] * decay


@pytest.mark.parametrize("x", [1e-12, 1e-8, 1e-5, 1e-4, 3e-4, 0.01, 0.5, 1.0, 7.0, 30.0])
def test_matches_van_loan(x):
    theta, sigma = 0.7, 1.3
    dt = x / theta
    decay, noise = ou.discretize(theta, sigma, dt)
    d_ref, q_ref = van_loan(theta, sigma, dt)
    assert abs(decay - d_ref) <= 1e-14 * d_ref
    assert abs(noise - q_ref) <= 1e-12 * q_ref


def test_random_walk_and_large_steps():
    decay, noise = ou.discretize(0.0, 2.0, 0.5)
    assert decay == 1.0 and noise == 2.0
    decay, noise = ou.discretize(1e3, 2.0, 1.0)
    assert decay == np.exp(-1e3) and noise == pytest.approx(4.0 / 2e3, rel=1e-15)
    # the small-x branch joins the exact branch without a jump
    lo, hi = ou.phi(np.nextafter(1e-4, 0)), ou.phi(1e-4)
    assert abs(lo - hi) < 1e-15


def test_phi_accuracy_across_branches():
    x = np.logspace(-12, 3, 2000)
    import mpmath

    ref = np.array([float(-mpmath.expm1(-mpmath.mpf(v)) / mpmath.mpf(v)) for v in x])
    assert np.max(np.abs(ou.phi(x) - ref) / ref) < 4e-16


def test_zero_order_hold():
    decay, noise = ou.discretize(0.5, 2.0, 3.0, method="zoh")
    assert decay == np.exp(-1.5) and noise == 12.0
    with pytest.raises(ValueError, match="method"):
        ou.discretize(0.5, 2.0, 3.0, method="euler")


def test_inverse_roundtrip():
    rng = np.random.default_rng(0)
    theta = np.concatenate([[0.0, 1e-9], rng.uniform(1e-6, 50, 200)])
    sigma = rng.uniform(0.01, 5, theta.shape)
    dt = rng.uniform(0.01, 2, theta.shape)
    t2, s2 = ou.continuous(*ou.discretize(theta, sigma, dt), dt)
    # decay = exp(-theta dt) holds theta dt only to float64 rounding (eps = 1.1e-16) near decay = 1,
    # so theta comes back to about eps / dt absolute; elsewhere to a few ulps relative.
    assert np.all(np.abs(t2 - theta) <= 4e-16 / dt + 1e-13 * theta)
    np.testing.assert_allclose(s2, sigma, rtol=1e-12)


def test_stationary_and_half_life():
    assert ou.stationary_var(2.0, 3.0) == 9.0 / 4.0
    assert np.isinf(ou.stationary_var(0.0, 1.0))
    assert ou.half_life(np.log(2.0)) == pytest.approx(1.0)
    decay, noise = ou.discretize(0.3, 1.1, 1e4)
    assert noise == pytest.approx(ou.stationary_var(0.3, 1.1), rel=1e-14)


def test_torch_elementwise_and_differentiable():
    theta = torch.tensor([0.0, 1e-6, 0.3, 5.0], dtype=torch.float64, requires_grad=True)
    sigma = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64, requires_grad=True)
    dt = torch.tensor(0.7, dtype=torch.float64)
    decay, noise = ou.discretize(theta, sigma, dt)
    d_np, q_np = ou.discretize(theta.detach().numpy(), sigma.detach().numpy(), 0.7)
    np.testing.assert_allclose(decay.detach().numpy(), d_np, rtol=1e-15)
    np.testing.assert_allclose(noise.detach().numpy(), q_np, rtol=1e-15)
    assert torch.autograd.gradcheck(lambda t, s: ou.discretize(t, s, dt), (theta, sigma))
    assert torch.autograd.gradcheck(lambda d, q: ou.continuous(d, q, dt),
                                    (decay.detach().clone()[1:].requires_grad_(),
                                     noise.detach().clone()[1:].requires_grad_()))
