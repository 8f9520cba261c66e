"""The lean objective of ks.fit (kalmanscan.estimation.likelihood): equal to ks.filter's log-likelihood, its
gradient equal across backends (cpu, torch, triton under the interpreter), the central-difference
Hessian equal to the torch backend's double-backward Hessian, and fits equal across backends."""

import math

import numpy as np
import pytest
import torch
from helpers import KERNEL_DEVICE

import kalmanscan as ks
from kalmanscan.datasets import load_nile, simulate
from kalmanscan.estimation.likelihood import Likelihood, gradient_and_hessian, valid


def _problem(seed=3, T=60, C=2, batch=()):
    rng = np.random.default_rng(seed)
    _, y = simulate(theta=np.full(C, 0.4), sigma=np.full(C, 1.0), obs_var=np.full(C, 0.5), T=T, seed=seed)
    y = np.broadcast_to(y, batch + y.shape).copy() + rng.normal(size=batch + y.shape) * 0.1
    y[rng.random(y.shape) < 0.15] = np.nan
    times = np.cumsum(rng.uniform(0.3, 1.5, T))
    start = dict(theta=torch.tensor(rng.uniform(0.2, 0.6, batch + (C,))),
                 sigma=torch.tensor(rng.uniform(0.5, 1.5, batch + (C,))),
                 obs_var=torch.tensor(rng.uniform(0.2, 0.8, batch + (C,))))
    return torch.tensor(y), times, start


def _grad(lik, nat):
    leaves = {k: v.clone().requires_grad_(True) for k, v in nat.items()}
    ll = lik(leaves)
    return ll.detach(), torch.autograd.grad(-ll.sum(), list(leaves.values()))


@pytest.mark.parametrize("fixed", [dict(mean=0.3), dict(mean=0.3, init_var=math.inf), dict(mean=0.3, init_mean=1.0,
                                                                                           init_var=2.0)])
def test_equals_filter_loglik_and_gradients_agree(fixed):
    y, times, start = _problem(batch=(2,))
    results = []
    for backend in ("cpu", "torch"):
        lik = Likelihood(y, fixed, start, times=times, backend=backend)
        ll, g = _grad(lik, start)
        post = ks.filter(y, **fixed, **{k: v.unsqueeze(-2) for k, v in start.items()}, times=times, backend=backend)
        torch.testing.assert_close(ll, post.loglik, rtol=1e-12, atol=0)
        results.append(g)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_triton_backend_equals_the_torch_backend():
    """The same objective on the triton backend (the GPU path; the Triton interpreter in CI)."""
    y, _, start = _problem(T=9, C=2)
    y, start = y.to(KERNEL_DEVICE), {k: v.to(KERNEL_DEVICE) for k, v in start.items()}
    got = [_grad(Likelihood(y, dict(mean=0.1), start, backend=b), start) for b in ("triton", "torch")]
    torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-10, atol=0)
    for a, b in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_hessian_equals_double_backward():
    """Central differences of the exact (compiled) gradient against torch's double backward."""
    y, times, start = _problem(batch=(2,))
    names = tuple(start)
    scale = torch.ones(2, 2, dtype=torch.float64)
    g, H = gradient_and_hessian(Likelihood(y, dict(mean=0.3), start, times=times, backend="cpu"), start, names, scale)
    ref = Likelihood(y, dict(mean=0.3), start, times=times, backend="torch")
    flat = torch.stack([start[k] for k in names])

    def nll(x):
        return -ref(dict(zip(names, x))).sum()

    H_ref = torch.autograd.functional.hessian(nll, flat)  # (P, 2, 2, P, 2, 2)
    for b in range(2):
        for c in range(2):
            block = H_ref[:, b, c, :, b, c]
            torch.testing.assert_close(H[b, c], block, rtol=1e-6, atol=1e-9 * block.abs().max().item())
    x = flat.clone().requires_grad_(True)
    g_ref = torch.autograd.grad(nll(x), x)[0]
    # the gradient is the differences' midpoint: second order in the step like the Hessian (1.1e-9 here)
    torch.testing.assert_close(g, g_ref.permute(1, 2, 0), rtol=1e-6, atol=0)


def test_valid_flags_out_of_domain_values_without_raising():
    ok = dict(theta=torch.tensor([0.1]), mean=torch.tensor([-3.0]))
    assert bool(valid(ok))
    assert not bool(valid({**ok, "theta": torch.tensor([0.0])}))
    assert not bool(valid({**ok, "mean": torch.tensor([math.inf])}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_fit_equals_torch_fit(dtype):
    """float64 and float32 tensors on the cpu backend against float64 on the torch backend (the
    standard errors of float32 data come from a float64 Hessian)."""
    truth = dict(theta=np.array([0.3, 0.8]), sigma=np.array([1.0, 0.5]), obs_var=np.array([0.5, 0.2]))
    _, y = simulate(T=150, seed=21, **truth)
    y[5:9, 1] = np.nan
    cpu = ks.fit(torch.tensor(y, dtype=dtype), backend="cpu")
    ref = ks.fit(y, backend="torch")
    assert cpu.converged and ref.converged
    # float32: the optimum of the float32 objective is up to 1.6e-3 (relative, measured) from the
    # float64 one, and the standard errors there differ by up to 3.3e-3: bounds with a factor of 2
    tol, se_tol = (1e-6, 1e-6) if dtype == torch.float64 else (3.2e-3, 6.6e-3)
    for k in cpu.names:
        np.testing.assert_allclose(cpu.params[k].double().numpy(), ref.params[k], rtol=tol)
        np.testing.assert_allclose(cpu.stderr[k].double().numpy(), ref.stderr[k], rtol=se_tol)
    assert cpu.cov.dtype == dtype and cpu.params["theta"].dtype == dtype


@pytest.mark.filterwarnings("ignore::statsmodels.tools.sm_exceptions.ConvergenceWarning")
def test_nile_diffuse_cpu_fit_equals_statsmodels():
    """The exact diffuse local level on Nile (the benchmark's fit) by default on the cpu backend."""
    import statsmodels.api as sm

    y = load_nile().y
    res = ks.fit(y, theta=0.0, init_var=math.inf, estimate=("sigma", "obs_var"))
    mod = sm.tsa.UnobservedComponents(y[:, 0], "llevel", use_exact_diffuse=True)
    ref = mod.fit(disp=False, method="bfgs", gtol=1e-10, maxiter=1000)  # tight: its default stops 1% off
    assert res.converged, res.message
    sigma2, obs_var = float(res.params["sigma"][0]) ** 2, float(res.params["obs_var"][0])
    assert abs(sigma2 / ref.params[1] - 1) < 1e-3 and abs(obs_var / ref.params[0] - 1) < 1e-3
    assert abs(float(res.loglik[0]) - ref.llf_obs[1:].sum()) < 1e-6 * abs(ref.llf)
    torch_fit = ks.fit(y, theta=0.0, init_var=math.inf, estimate=("sigma", "obs_var"), backend="torch")
    for k in res.names:
        np.testing.assert_allclose(res.stderr[k], torch_fit.stderr[k], rtol=1e-6)


def _lean_case(case):
    """Random problems for the NumPy objective: (y, fixed, start, times)."""
    rng = np.random.default_rng(7)
    T, C, batch = (63, 3, (2,))
    y = rng.normal(size=batch + (T, C)).cumsum(-2) * 0.3 + rng.normal(size=batch + (T, C))
    y[rng.random(y.shape) < 0.2] = np.nan
    times = np.cumsum(rng.uniform(0.2, 1.7, T))
    Cp = 1 if case == "shared" else C

    def draw(lo, hi):
        return torch.tensor(rng.uniform(lo, hi, batch + (Cp,)))

    start = dict(theta=draw(0.05, 0.8), sigma=draw(0.3, 1.5), obs_var=draw(0.2, 1.2), mean=draw(-0.5, 0.5))
    fixed = {}
    if case == "diffuse":
        y[0, :5, 0] = np.nan  # a leading gap: identity transitions up to the first observation
        y[1, :, 2] = np.nan   # a channel never observed
        fixed = dict(init_var=math.inf)
    elif case == "init":
        start = dict(sigma=start["sigma"], init_mean=draw(-1.0, 1.0), init_var=draw(0.5, 2.0))
        fixed = dict(theta=0.3, obs_var=torch.tensor(rng.uniform(0.2, 1.0, (T, C))), mean=0.1)
    elif case == "random_walk":
        y[:, :3, 1] = np.nan
        start = dict(sigma=start["sigma"], obs_var=start["obs_var"])
        fixed = dict(theta=0.0, init_var=math.inf, mean=0.0)
    return torch.tensor(y), fixed, start, (None if case == "random_walk" else times)


@pytest.mark.parametrize("case", ["stationary", "diffuse", "shared", "init", "random_walk"])
def test_numpy_objective_equals_torch_path(case):
    """The lean NumPy evaluation (cpu backend, float64) against autograd through the same loops:
    the log-likelihood and the gradient of a weighted sum to 1e-12 relative."""
    y, fixed, start, times = _lean_case(case)
    lik = Likelihood(y, fixed, start, times=times, backend="cpu")
    assert lik.numpy is not None
    cot = torch.tensor(np.random.default_rng(1).uniform(-2.0, 0.5, tuple(y.shape[:-2]) + (y.shape[-1],)))
    leaves = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    ll_ref = lik(leaves)
    g_ref = torch.autograd.grad((cot * ll_ref).sum(), list(leaves.values()))
    ll, g = lik.numpy.evaluate({k: v.numpy() for k, v in start.items()}, cot.numpy())
    np.testing.assert_allclose(ll, ll_ref.detach().numpy(), rtol=1e-12, atol=0)
    with torch.no_grad():
        np.testing.assert_allclose(lik(start).numpy(), ll_ref.detach().numpy(), rtol=1e-12, atol=0)
    for k, ref in zip(start, g_ref):
        assert np.all(np.isfinite(g[k])), k
        np.testing.assert_allclose(g[k], ref.numpy(), rtol=1e-12, atol=1e-12 * np.abs(ref.numpy()).max(), err_msg=k)
    names = tuple(start)
    g_sum = torch.autograd.grad(-lik(leaves).sum(), list(leaves.values()))
    got = lik.gradient(start, names[::-1])  # any order of the names
    for i, k in enumerate(names[::-1]):
        ref = g_sum[names.index(k)]
        torch.testing.assert_close(got[..., i], ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


def test_spd_inverse_equals_torch_cholesky_inverse():
    """The NumPy Cholesky of the CPU covariance against torch's, flagging the blocks that are not
    positive definite (or not finite) as ``cholesky_ex`` does."""
    from kalmanscan.estimation.likelihood import spd_inverse

    g = torch.Generator().manual_seed(0)
    for P in (1, 2, 3, 6):
        X = torch.randn(4, 3, P, P + 2, dtype=torch.float64, generator=g)
        H = X @ X.transpose(-1, -2)
        H[0, 0] = -H[0, 0]
        H[1, 2, 0, 0] = math.nan
        cov, bad = spd_inverse(H)
        L, info = torch.linalg.cholesky_ex(H)
        expected_bad = (info != 0) | ~torch.isfinite(L).all(-1).all(-1)
        assert torch.equal(bad, expected_bad) and bool(bad[0, 0]) and bool(bad[1, 2])
        ok = ~bad
        ref = torch.cholesky_inverse(torch.where(bad[..., None, None], torch.eye(P, dtype=H.dtype), L))
        torch.testing.assert_close(cov[ok], ref[ok], rtol=1e-10, atol=1e-12 * ref[ok].abs().max().item())


def test_discretize_vjp_equals_autograd():
    """The adjoint of the OU discretisation (NumPy and torch) against autograd through
    kalmanscan.model.ou.discretize, for theta, sigma and dt, across the Taylor threshold of phi (both
    branches in one array, and each alone)."""
    from kalmanscan.model import ou

    rng = np.random.default_rng(5)
    for theta in (np.array([0.0, 1e-7, 4.9e-5, 5.1e-5, 0.3, 2.0, 700.0]), np.zeros(3), np.array([0.5, 1.5, 3.0])):
        sigma, dt = rng.uniform(0.5, 2.0, theta.shape), rng.uniform(0.5, 1.0, theta.shape)
        g_a, g_q = rng.normal(size=theta.shape), rng.normal(size=theta.shape)
        leaves = [torch.tensor(v, requires_grad=True) for v in (theta, sigma, dt)]
        decay, noise = ou.discretize(*leaves)
        ref = torch.autograd.grad((decay * torch.tensor(g_a)).sum() + (noise * torch.tensor(g_q)).sum(), leaves)
        got_np = ou.discretize_vjp(theta, sigma, dt, g_a, g_q)
        got_t = ou.discretize_vjp(*(torch.tensor(v) for v in (theta, sigma, dt, g_a, g_q)))
        for a, t, b in zip(got_np, got_t, ref):
            # absolute floor: at theta dt = 700 autograd's d noise / d dt is sigma^2 (phi + x phi'),
            # a cancellation that leaves ~1e-20 where the exact sigma^2 exp(-x) is ~1e-298
            atol = 1e-15 * float(b.abs().max())
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-12, atol=atol)
            np.testing.assert_allclose(t.numpy(), b.numpy(), rtol=1e-12, atol=atol)


def test_graphed_likelihood_is_nan_where_a_filter_lacks_process_noise():
    """``graphed=True`` takes no host decision: where some filter has no process noise the value is
    NaN (the eager call decides there); elsewhere it is the eager value."""
    y, times, start = _problem()
    lik = Likelihood(y, dict(mean=0.3, init_var=2.0), start, times=times, backend="torch")
    torch.testing.assert_close(lik(start, graphed=True), lik(start), rtol=0, atol=0)
    quiet = dict(start, sigma=torch.tensor([1.0, 1e-200], dtype=torch.float64))
    assert torch.isnan(lik(quiet, graphed=True)).all() and torch.isfinite(lik(quiet)).all()


@pytest.mark.gpu
def test_graphed_fit_equals_the_eager_fit(monkeypatch):
    """On the GPU's triton backend L-BFGS replays its evaluations from a CUDA graph: the same
    kernels on the same values, so the same fit as the eager evaluations; a step that leaves a
    filter without process noise is answered eagerly."""
    from kalmanscan.estimation.graphed import GraphedEvaluation
    from kalmanscan.tuning import tuned

    rng = np.random.default_rng(3)
    _, y = simulate(T=300, seed=2, theta=rng.uniform(0.1, 0.5, 16), sigma=1.0, obs_var=0.5)
    y = torch.tensor(y, dtype=torch.float32, device="cuda")
    replays = []
    call = GraphedEvaluation.__call__
    monkeypatch.setattr(GraphedEvaluation, "__call__", lambda self, x: replays.append(1) or call(self, x))
    graphed = ks.fit(y, progress=False)
    with tuned(fit_graphs=False):
        eager = ks.fit(y, progress=False)
    assert len(replays) > 5 and graphed.n_iter == eager.n_iter
    for k in graphed.names:
        torch.testing.assert_close(graphed.params[k], eager.params[k], rtol=1e-6, atol=0)
        torch.testing.assert_close(graphed.stderr[k], eager.stderr[k], rtol=1e-5, atol=0)
