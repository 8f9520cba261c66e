"""The closed-form forward (static parameters, regular dt; kernels under TRITON_INTERPRET=1) against
the float64 reference and the general walks.

Tiles are kept small (``closed_tile``) so that short series cross several chunks, and
``closed_programs`` chooses between one stretch per series and a time split (aggregate, carry,
then the closed-form walk from each stretch's start). The interpreter's cost grows with the
chunks a program visits, so every case visits at most about eight.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import helpers
from helpers import (FLOAT32_BOUND, KERNEL_DEVICE, NAMES, POSITIVE, Launches, max_rel_error, posterior_error, prepared,
                     problem_tensors, random_problem, rel_error, triton_filter)

import kalmanscan as ks
from kalmanscan.inputs import prepare
from kalmanscan.kernels.filter.closed import closed_power
from kalmanscan.ops.filter import closed


def config(**options):
    """The default launch configuration with the closed-form path on (it is opt-in)."""
    return helpers.config(**{"closed": True, **options})


ONE = config(closed_tile=64, closed_programs=1)                  # tiles [16, 4]: chunks of 16, one stretch
SPLIT = config(closed_tile=32, closed_block=4, closed_programs=8)  # chunks of 8, time split into stretches
WIDE = config(closed_tile=64, closed_programs=1, wide_from=0)    # 64-bit offsets

# (T, config, batch, C, missing): one step; 63 steps in 4 chunks (the last of 15); ~1000 steps in
# 8 chunks of 128 with gaps; 61 steps on stretches of one chunk of 8 (the last of 5), with and
# without gaps; 64-bit offsets.
CASES = [
    (1, ONE, (2,), 3, 0.0),
    (63, ONE, (), 3, 0.0),
    (63, ONE, (2,), 3, 0.15),
    (1001, config(closed_tile=128, closed_block=1, closed_programs=1), (), 1, 0.1),
    (61, SPLIT, (), 3, 0.0),
    (61, SPLIT, (2,), 2, 0.15),
    (37, WIDE, (2,), 3, 0.1),
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-C{c[3]}-miss{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_closed_equals_reference(case, dtype, poisoned):
    """Every posterior field in one pass: float64 to 1e-10, float32 within :data:`FLOAT32_BOUND`."""
    T, cfg, batch, C, missing = case
    rng = np.random.default_rng(T + 10 * C + int(100 * missing))
    y, kw = random_problem(rng, T, C=C, batch=batch, missing=missing,
                           offset=100.0 if dtype == torch.float32 else 0.0)
    launches = Launches(closed.closed_fwd_kernel)
    closed.closed_fwd_kernel = launches
    try:
        out = triton_filter(prepared(y, kw, dtype)[0], cfg)
    finally:
        closed.closed_fwd_kernel = launches.kernel
    assert launches.count == 1
    err, errs = posterior_error(out, ks.filter(y, backend="reference", **kw))
    assert err < (1e-10 if dtype == torch.float64 else FLOAT32_BOUND), errs


def test_per_step_parameters_and_times_take_the_walks(monkeypatch):
    """The closed form serves static parameters with a regular dt only."""
    launches = Launches(closed.closed_fwd_kernel)
    monkeypatch.setattr(closed, "closed_fwd_kernel", launches)
    rng = np.random.default_rng(1)
    for per_step, times in ((True, False), (False, True)):
        y, kw = random_problem(rng, 9, per_step=per_step, times=times)
        triton_filter(prepared(y, kw)[0], ONE)
    assert launches.count == 0
    y, kw = random_problem(rng, 9)
    triton_filter(prepared(y, kw)[0], config(closed=False))
    assert launches.count == 0
    triton_filter(prepared(y, kw)[0], ONE)
    assert launches.count == 1


THETA_DT = np.array([1e-8, 3e-5, 1e-4, 0.3, 30.0, 1e3])
OBS_VAR = np.array([1e-8, 1e-3, 1.0, 1e4, 1e8])
FIELDS = ("var", "precision", "pred_var", "pred_precision", "pred_obs_var", "mean", "pred_mean")


@pytest.mark.parametrize("missing,init_var", [(0.0, 1e-6), (0.2, 1e6)])
def test_extreme_parameters_float32(missing, init_var):
    """theta dt from 1e-8 (rho -> 1: the closed form's expm1 form) to 1e3 (decay underflows),
    obs_var from 1e-8 to 1e8, initial precision far above and below the fixed point: the closed
    form (steady, closed-form and scanned chunks) and the walks, both in float32, within
    :data:`FLOAT32_BOUND` of the float64 reference on every moment (measured: at most 1.4e-6
    for either path)."""
    rng = np.random.default_rng(3)
    y = rng.normal(size=(len(THETA_DT), 33, len(OBS_VAR))) * np.sqrt(OBS_VAR)
    y[rng.random(y.shape) < missing] = np.nan
    kw = dict(theta=(THETA_DT / 0.7)[:, None, None], sigma=2.0, obs_var=OBS_VAR, dt=0.7, init_var=init_var)
    ref = ks.filter(y, backend="reference", **kw)
    p = prepare(torch.tensor(y, dtype=torch.float32, device=KERNEL_DEVICE),
                **{k: torch.tensor(v, dtype=torch.float32, device=KERNEL_DEVICE) if isinstance(v, np.ndarray) else v
                   for k, v in kw.items()})
    for cfg in (ONE, config(closed=False)):
        out = triton_filter(p, cfg)
        errs = {k: (rel_error if k in POSITIVE else max_rel_error)(getattr(out, k), getattr(ref, k)) for k in FIELDS}
        assert max(errs.values()) < FLOAT32_BOUND, (cfg.closed, errs)


@triton.jit
def _power_kernel(lam0_ptr, k_ptr, consts_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    c = consts_ptr + i
    out = closed_power(tl.load(lam0_ptr + i), tl.load(k_ptr + i), tl.load(c + 5 * N), tl.load(c + 6 * N),
                       tl.load(c + 9 * N), tl.load(c + 10 * N), tl.load(c + 11 * N))
    tl.store(out_ptr + i, out)


def test_closed_power_float32_against_float64_recursion():
    """The closed form alone, in float32, from initial precisions 1e-6 to 1e6 times the fixed
    point, after 0 to 10^5 steps, over the extreme parameters: within 8 ulps (1e-6 relative) of
    the float64 recursion."""
    theta_dt, obs_var, scale, k = (x.ravel() for x in np.meshgrid(THETA_DT, OBS_VAR, [1e-6, 0.5, 2.0, 1e6],
                                                                   [0, 1, 7, 100, 100000], indexing="ij"))
    n = len(k)
    one = torch.ones(1, n, dtype=torch.float64)
    consts = closed.constants(one * torch.tensor(theta_dt), one * 2.0, one, one * torch.tensor(obs_var), one * 0.0,
                              one, torch.float64)[0]
    lam0 = scale * consts[5].numpy()
    a, q, phi = consts[0].numpy(), consts[1].numpy(), 1.0 / obs_var
    want = lam0.copy()
    for step in range(int(k.max())):
        moving = step < k
        want = np.where(moving, want / (a * a + q * want) + phi, want)
    size = triton.next_power_of_2(n)
    pad = lambda x: torch.cat([torch.as_tensor(x, dtype=torch.float32), torch.ones(size - n)]).to(KERNEL_DEVICE)  # noqa: E731
    c32 = torch.stack([pad(row) for row in consts.float()]).contiguous()
    got = torch.empty(size, device=KERNEL_DEVICE)
    _power_kernel[(1,)](pad(lam0), pad(k), c32, got, N=size)
    rel = np.abs(got[:n].double().cpu().numpy() - want) / want
    assert rel.max() < 1e-6, rel.max()


def test_gradcheck_float64():
    """Finite differences through the closed-form forward and the backward walks (which read its
    filtered mean and precision back), two chunks (4 and 2 steps), with a gap."""
    rng = np.random.default_rng(21)
    y, kw = random_problem(rng, 6, C=2, batch=(1,), missing=0.15)
    t = problem_tensors(kw, grad=True, device=KERNEL_DEVICE)
    t["dt"].requires_grad_()
    names = NAMES + ("dt",)
    cfg = config(closed_tile=8, closed_block=2, closed_programs=1)

    def f(y_t, *params):
        post = triton_filter(prepare(y_t, **dict(zip(names, params))), cfg)
        return (post.loglik.sum() + (post.mean * 0.3).sum() + post.var.sum() + post.pred_mean.sum()
                + post.pred_var.sum())

    y_t = torch.tensor(y, requires_grad=True, device=KERNEL_DEVICE)
    assert torch.autograd.gradcheck(f, (y_t, *(t[k] for k in names)), atol=1e-6, rtol=1e-5, fast_mode=True)


def test_outputs_selection_writes_only_those(poisoned):
    rng = np.random.default_rng(5)
    y, kw = random_problem(rng, 40, C=3, batch=())
    y_t = torch.tensor(y, device=KERNEL_DEVICE)
    full = ks.filter(y_t, backend="triton", **kw)
    part = ks.filter(y_t, backend="triton", outputs=("mean", "var"), **kw)
    assert part.precision is None and part.logliks is None
    torch.testing.assert_close(part.mean, full.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part.var, full.var, rtol=1e-12, atol=1e-12)


def test_plan():
    assert closed.plan(1, 32768, 4096) == (1, 512, 64, 32)
    assert closed.plan(1, 1 << 22, 1) == (128, 16, 2048, 1)
    assert closed.plan(1, 63, 3, ONE) == (1, 4, 16, 4)
    assert closed.plan(1, 61, 3, SPLIT) == (8, 1, 8, 4)
    assert closed.plan(2, 5, 3) == (1, 1, 8, 4)


def _walk_precision_float32(y, decay, noise, phi, lam0, bias, newton):
    """The walks' precision recursion in float32 with NumPy, its reciprocal ``bias`` ulps off
    (the hardware's is at most one) and optionally refined by one Newton step (FMAs emulated in
    float64, where the product of two float32 numbers is exact)."""
    f32, f64 = np.float32, np.float64

    def reciprocal(x):
        r = (f32(1) / x * f32(1 + bias * np.finfo(f32).eps)).astype(f32)
        if newton:
            e = (1.0 - x.astype(f64) * r.astype(f64)).astype(f32)
            r = (r.astype(f64) * e.astype(f64) + r.astype(f64)).astype(f32)
        return r

    lam, out = lam0, []
    for t in range(y.shape[1]):
        a, q = (f32(1), f32(0)) if t == 0 else (decay, noise)
        lam = (reciprocal((a * a + q * lam).astype(f32)) * lam + np.where(np.isnan(y[:, t]), f32(0), phi)).astype(f32)
        out.append(lam)
    return np.stack(out, 1)


def test_newton_step_on_the_reciprocal_keeps_nearly_neutral_steps_accurate():
    """Why ``info_step`` refines its reciprocal (docs/math.md, "The reciprocal in float32"): on
    the extreme matrix with 20% missing, a reciprocal one ulp off at every step (as the GPU's may
    be) walks the float32 precision past :data:`FLOAT32_BOUND` (4.3e-6 low, 5.1e-6 high; 1.2e-6
    correctly rounded), and one Newton step brings it back to the correctly rounded walk's."""
    rng = np.random.default_rng(3)
    y = rng.normal(size=(len(THETA_DT), 33, len(OBS_VAR))) * np.sqrt(OBS_VAR)
    y[rng.random(y.shape) < 0.2] = np.nan
    kw = dict(theta=(THETA_DT / 0.7)[:, None, None], sigma=2.0, obs_var=OBS_VAR, dt=0.7, init_var=1e6)
    ref = np.asarray(ks.filter(y, backend="reference", **kw).precision)
    decay, noise = (np.broadcast_to(x, (len(THETA_DT), 1, len(OBS_VAR)))[:, 0].astype(np.float32)
                    for x in ks.ou.discretize(kw["theta"], 2.0, 0.7))
    phi = np.broadcast_to((np.float32(1) / OBS_VAR.astype(np.float32)), decay.shape)
    lam0 = np.full(decay.shape, np.float32(1e-6))

    def error(bias, newton):
        return float(np.max(np.abs(_walk_precision_float32(y, decay, noise, phi, lam0, bias, newton) / ref - 1)))

    exact = error(0, False)
    assert exact < FLOAT32_BOUND / 3
    assert min(error(-1, False), error(1, False)) > FLOAT32_BOUND
    for bias in (-1, 1):
        assert error(bias, True) <= 1.01 * exact
