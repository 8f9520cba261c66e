"""The triton backend (kernels under TRITON_INTERPRET=1 on the CPU) against the float64 reference.

The kernels compute in the problem's dtype, so float64 inputs are checked to float64 rounding and
by gradcheck; float32 inputs against the float64 reference within a measured bound. ``stretches``
shrinks the stretch length so that small problems cross many stretch boundaries (aggregate, carry
and apply kernels, forward and backward); without it a small problem runs as one stretch.
"""

import math

import numpy as np
import pytest
import torch
from helpers import FLOAT32_BOUND, NAMES, posterior_error, problem_tensors, random_problem

import kalmanscan as ks
from kalmanscan import fused
from kalmanscan.filtering import make_posterior
from kalmanscan.inputs import prepare



@pytest.mark.parametrize("T,split", [(1, False), (63, False), (1, True), (63, True), (201, True)])
@pytest.mark.parametrize("per_step,times", [(False, False), (True, True), (True, False)])
def test_triton_equals_reference_float64(T, per_step, times, split, request):
    if split:
        request.getfixturevalue("stretches")
    request.getfixturevalue("poisoned")
    rng = np.random.default_rng(100 * T + 10 * per_step + times)
    y, kw = random_problem(rng, T, per_step=per_step, times=times, missing=0.15)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y), backend="triton", **problem_tensors(kw))
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs


def test_offsets_batch_broadcast_and_random_walk(stretches):
    rng = np.random.default_rng(3)
    T = 37
    y = 1e4 + np.cumsum(rng.normal(size=(T, 2)), 0)
    y[5:9, 1] = np.nan
    kw = dict(theta=torch.tensor([[[0.0, 0.3]], [[0.2, 1.5]]]), sigma=torch.tensor([1.0, 0.4]),
              obs_var=0.5, mean=1e4, h=torch.tensor([1.0, -2.0]), init_var=torch.tensor([3.0, 0.5]),
              times=np.cumsum(rng.uniform(0.1, 2.0, T)))
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y), backend="triton", **kw)
    assert out.mean.shape == (2, T, 2)
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs


@pytest.mark.parametrize("T", [1, 63, 301])
def test_float32_within_measured_bound(T, stretches, poisoned):
    rng = np.random.default_rng(7 + T)
    worst = 0.0
    for per_step, times in ((False, False), (True, True)):
        y, kw = random_problem(rng, T, per_step=per_step, times=times, offset=100.0)
        ref = ks.filter(y, backend="reference", **kw)
        out = ks.filter(torch.tensor(y, dtype=torch.float32), backend="triton", **problem_tensors(kw, torch.float32))
        assert out.mean.dtype == torch.float32
        worst = max(worst, posterior_error(out, ref)[0])
    assert worst < FLOAT32_BOUND


def test_half_precision_input_returns_its_dtype():
    rng = np.random.default_rng(4)
    y, kw = random_problem(rng, 20, missing=0.0)
    y16 = torch.tensor(y, dtype=torch.float16)
    out = ks.filter(y16, backend="triton", **kw)
    ref = ks.filter(y16.float(), backend="torch", **kw)
    assert out.mean.dtype == torch.float16
    torch.testing.assert_close(out.mean, ref.mean.half())


def _loss(post):
    return (post.loglik.sum() + (post.mean * 0.3).sum() + post.var.sum() + post.pred_mean.sum()
            + post.pred_var.sum())


@pytest.mark.parametrize("per_step,times", [(False, False), (True, True)])
def test_gradcheck_float64(per_step, times, stretches):
    rng = np.random.default_rng(20 + per_step)
    y, kw = random_problem(rng, 6, C=2, batch=(1,), per_step=per_step, times=times, missing=0.15)
    t = problem_tensors(kw, grad=True)
    names = NAMES if times else NAMES + ("dt",)
    if not times:
        t["dt"].requires_grad_()
    fixed = {k: v for k, v in t.items() if k not in names}

    def f(y_t, *params):
        return _loss(ks.filter(y_t, backend="triton", **dict(zip(names, params)), **fixed))

    y_t = torch.tensor(y, requires_grad=True)
    assert torch.autograd.gradcheck(f, (y_t, *(t[k] for k in names)), atol=1e-6, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("per_step,times", [(False, False), (True, True), (True, False)])
def test_gradients_equal_torch_autograd(per_step, times, stretches, poisoned):
    rng = np.random.default_rng(40 + 2 * per_step + times)
    y, kw = random_problem(rng, 63, C=3, batch=(2,), per_step=per_step, times=times, missing=0.15)
    weights = [torch.tensor(rng.normal(size=(2, 63, 3))) for _ in range(3)]
    grads = {}
    for backend in ("torch", "triton"):
        t = problem_tensors(kw, grad=True)
        y_t = torch.tensor(y, requires_grad=True)
        post = ks.filter(y_t, backend=backend, **t)
        loss = sum((getattr(post, k) * w).sum() for k, w in zip(("mean", "var", "logliks"), weights))
        loss = loss + (post.pred_mean * post.pred_var).sum()
        grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in NAMES])
    for name, a, b in zip(("y",) + NAMES, grads["torch"], grads["triton"]):
        assert torch.all(torch.isfinite(b)), name
        assert float((a - b).norm() / a.norm()) < 1e-10, name


@pytest.mark.parametrize("batch", [(), (2,)])
def test_wide_offsets(batch, stretches, poisoned, monkeypatch):
    """The 64-bit-offset variant (arrays of 2^31 elements or more) forced on a small problem."""
    monkeypatch.setattr(fused, "WIDE_FROM", 0)
    rng = np.random.default_rng(7 + len(batch))
    y, kw = random_problem(rng, 63, C=3, batch=batch, per_step=True, times=True, missing=0.15)
    ref = ks.filter(y, backend="reference", **kw)
    t = problem_tensors(kw, grad=True)
    y_t = torch.tensor(y, requires_grad=True)
    out = ks.filter(y_t, backend="triton", **t)
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs
    wide = torch.autograd.grad(_loss(out), [y_t] + [t[k] for k in NAMES])
    t = problem_tensors(kw, grad=True)
    y_t = torch.tensor(y, requires_grad=True)
    narrow = torch.autograd.grad(_loss(ks.filter(y_t, backend="torch", **t)), [y_t] + [t[k] for k in NAMES])
    for name, a, b in zip(("y",) + NAMES, narrow, wide):
        assert float((a - b).norm() / a.norm()) < 1e-10, name


def test_missing_values_give_zero_gradient():
    y = torch.tensor([[1.0], [float("nan")], [0.5]], dtype=torch.float64, requires_grad=True)
    theta = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    ks.filter(y, theta=theta, sigma=1.0, obs_var=0.5, backend="triton").loglik.sum().backward()
    assert torch.isfinite(theta.grad) and y.grad[1, 0] == 0 and torch.all(torch.isfinite(y.grad))


def test_smoother_on_triton_filter(stretches):
    rng = np.random.default_rng(50)
    y, kw = random_problem(rng, 23, C=2, per_step=True, times=True, missing=0.2)
    ref = ks.smooth(y, backend="reference", **kw)
    out = ks.smooth(torch.tensor(y), backend="triton", **problem_tensors(kw))
    err, errs = posterior_error(out, ref, fields=("mean", "var", "precision"))
    assert err < 1e-10, errs
    grads = {}
    for backend in ("torch", "triton"):
        t = problem_tensors(kw, grad=True)
        post = ks.smooth(torch.tensor(y), backend=backend, **t)
        grads[backend] = torch.autograd.grad((post.mean * 0.7 + post.var).sum(), [t[k] for k in NAMES])
    for name, a, b in zip(NAMES, grads["torch"], grads["triton"]):
        assert float((a - b).norm() / a.norm()) < 1e-10, name


@pytest.mark.parametrize("C", [4, 1])
def test_only_requested_outputs_are_written(C, poisoned, request):
    if C == 1:
        request.getfixturevalue("tiles")
    rng = np.random.default_rng(60)
    y, kw = random_problem(rng, 50, C=C, batch=())
    assert fused.uses_tiles(50, C) == (C == 1)
    p = prepare(torch.tensor(y), **kw)
    full = make_posterior(p, fused.filter_triton(p))
    views = {k: fused._flat(getattr(p, k), p.shape) for k in fused._ORDER}
    init = torch.stack([1.0 / p.init_var.reshape(1, C),
                        (p.init_mean - p.mean[..., :1, :]).reshape(1, C) / p.init_var.reshape(1, C)], 1)
    out = fused.filter_forward(views, init, outputs=("mu",))
    assert set(out) == {"mu"}
    torch.testing.assert_close(out["mu"][0] + p.mean, full.mean, rtol=1e-12, atol=1e-12)


def test_plan_regimes():
    assert fused.plan(1, 32768, 4096) == (64, 512)
    assert fused.plan(1, 1 << 20, 64) == (4096, 256)
    assert fused.plan(1, 1 << 22, 1) == (fused.MAX_STRETCHES, 256)
    assert fused.plan(1, 63, 8) == (1, 63)
    assert fused.plan(2, 10, 3, stretch=4) == (3, 4)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        ks.filter(torch.zeros(3, 1), theta=1.0, sigma=1.0, obs_var=1.0, backend="triton")


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_inf_in_y_is_refused_after_the_kernels(value):
    """The fused path looks for inf only when the log-likelihood is non-finite: still a ValueError."""
    y = torch.randn(40, 3, dtype=torch.float64)
    y[17, 1] = value
    y[5, 2] = math.nan
    with pytest.raises(ValueError, match="y must be finite or NaN"):
        ks.filter(y, backend="triton", theta=0.1, sigma=1.0, obs_var=0.5)
    with pytest.raises(ValueError, match="y must be finite or NaN"):
        ks.filter(y, backend="torch", theta=0.1, sigma=1.0, obs_var=0.5)


def test_stretch_total_kernel_equals_torch_products(stretches, monkeypatch):
    """The distributed summary's kernel path (aggregate + total over many chunks of stretches)."""
    from kalmanscan.distributed import series

    monkeypatch.setattr(fused, "CARRY_CHUNK", 4)
    rng = np.random.default_rng(11)
    y, kw = random_problem(rng, 201, C=3, batch=(2,), per_step=True, times=False, missing=0.15)
    p = prepare(torch.tensor(y), backend="triton", **problem_tensors(kw))
    got = torch.stack(series._summary(p, 0, True))
    want = torch.stack(series._summary(p, 0, False))
    got, want = got / (got[0] + got[3]), want / (want[0] + want[3])  # the maps act projectively
    assert float((got - want).abs().max()) < 1e-12


@pytest.mark.parametrize("T,split", [(1, False), (3, False), (63, False), (5, True), (201, True)])
@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_ring(T, split, prefetch, poisoned, monkeypatch, request):
    """The forward walks with y loaded four steps ahead (the default without the posterior;
    stretches shorter and longer than 4) and with plain loads."""
    if split:
        request.getfixturevalue("stretches")
    monkeypatch.setattr(fused, "PREFETCH", prefetch)
    monkeypatch.setattr(fused, "POSTERIOR_PREFETCH", prefetch)
    rng = np.random.default_rng(30 + T)
    y, kw = random_problem(rng, T, per_step=split, times=split, missing=0.15)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y), backend="triton", **problem_tensors(kw))
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_process_noise_stays_finite(backend):
    """sigma = 0 with decay < 1: the exact precision grows like decay^(-2t) past float32's range
    (about 440 steps here); both backends must return the exact, finite answer."""
    rng = np.random.default_rng(5)
    y = rng.normal(size=(1000, 3))
    y[rng.random(y.shape) < 0.1] = np.nan
    kw = dict(theta=np.array([1.0, 0.1, 0.0]), sigma=0.0, obs_var=0.7, init_var=2.0, mean=0.5)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y, dtype=torch.float32), backend=backend,
                    **{k: torch.tensor(v, dtype=torch.float32) for k, v in kw.items()})
    for name in ("mean", "var", "pred_mean", "pred_var", "logliks"):
        got = getattr(out, name).double().numpy()
        want = np.asarray(getattr(ref, name))
        assert np.isfinite(got).all(), name
        assert np.abs(got - want).max() <= 4e-6 * max(np.abs(want).max(), 1.0), name



@pytest.mark.parametrize("T", [16, 17, 63, 201, 1000])
@pytest.mark.parametrize("per_step,times", [(False, False), (True, True), (True, False)])
def test_time_parallel_forward_equals_reference(T, per_step, times, tiles, poisoned):
    assert fused.uses_tiles(T, 1)
    rng = np.random.default_rng(700 + T + 10 * per_step + times)
    _assert_equals_reference_both_dtypes(*random_problem(rng, T, C=1, batch=(2,), per_step=per_step, times=times,
                                                         missing=0.15))


def _assert_equals_reference_both_dtypes(y, kw):
    """The triton backend's filter of ``y`` within 1e-10 of the reference in float64 and within
    :data:`FLOAT32_BOUND` in float32."""
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y), backend="triton", **problem_tensors(kw))
    err, errs = posterior_error(out, ref)
    assert err < 1e-10, errs
    out32 = ks.filter(torch.tensor(y, dtype=torch.float32), backend="triton", **problem_tensors(kw, torch.float32))
    err, errs = posterior_error(out32, ref)
    assert err < FLOAT32_BOUND, errs


def test_time_parallel_plan(tiles):
    assert fused.tile_plan(16) == (1, 1)
    assert fused.tile_plan(17) == (2, 1)
    assert fused.tile_plan(201) == (4, 4)   # 13 tiles: 4 stretches of 4 (the last of 1)
    assert fused.tile_plan(1000) == (4, 16)
    assert fused.TILE % fused.TILE_ROW == 0 and fused.TILE_ROW & (fused.TILE_ROW - 1) == 0
    assert not fused.uses_tiles(15, 1) and not fused.uses_tiles(64, 2) and not fused.uses_tiles(64, 1, 8)


@pytest.mark.parametrize("row", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("T,per_step", [(37, False), (131, True)])
def test_time_parallel_rows_equal_reference(T, per_step, row, tiles, poisoned, monkeypatch):
    """Tiles of 16 steps cut into rows of ``row`` steps (16 rows of one step up to one row of 16): T
    is no multiple of the row, so the series' last tile ends mid-row (37 = 2 tiles + 5 steps: 3
    stretches of one tile; 131 = 8 tiles + 3: 3 stretches of 3 tiles, the last of 3 steps)."""
    monkeypatch.setattr(fused, "TILE_ROW", row)
    rng = np.random.default_rng(900 + T + row)
    _assert_equals_reference_both_dtypes(*random_problem(rng, T, C=1, batch=(2,), per_step=per_step,
                                                         times=per_step, missing=0.15))


@pytest.mark.parametrize("T", [63, 201])
def test_time_parallel_gradients_equal_torch_autograd(T, tiles, poisoned):
    """The autograd path's forward (centred outputs only) on tiles, its backward on the walks."""
    rng = np.random.default_rng(80 + T)
    y, kw = random_problem(rng, T, C=1, per_step=True, times=True, missing=0.15)
    grads = {}
    for backend in ("torch", "triton"):
        t = problem_tensors(kw, grad=True)
        yt = torch.tensor(y, requires_grad=True)
        grads[backend] = torch.autograd.grad(_loss(ks.filter(yt, backend=backend, **t)),
                                             [yt] + [t[k] for k in NAMES])
    for name, a, b in zip(("y",) + NAMES, grads["torch"], grads["triton"]):
        assert float((a - b).norm() / a.norm()) < 1e-10, name
