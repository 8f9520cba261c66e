"""The triton backend's forward (kernels under TRITON_INTERPRET=1 on the CPU) against the float64
reference.

The kernels compute in the problem's dtype, so float64 inputs are checked to float64 rounding and
by gradcheck; float32 inputs against the float64 reference within a measured bound. The launch is
set by explicit :class:`~kalmanscan.ops.filter.triton.config.FilterConfig` s: small stretches, carry
chunks and tiles make small problems cross many boundaries (aggregate, carry and apply kernels).
The interpreter's cost grows with the steps a lane walks in sequence, not with the lanes, so every
problem here walks at most ~64 steps per lane; breadth comes from channels and stretches, and the
options are combined in Latin squares instead of full products.
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
from helpers import (FLOAT32_BOUND, KERNEL_DEVICE, NAMES, POSITIVE, config, max_rel_error, posterior_error, prepared,
                     problem_tensors, random_problem, rel_error, triton_filter)

import kalmanscan as ks
from kalmanscan.inference.filtering import make_posterior, sum_time
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter.triton import backend as triton

ONE = config()                                                   # T < 128: one stretch
FOURS = config(min_stretch=4, target_lanes=1 << 30)              # stretches of 4 to 7 steps
CHUNKS = config(min_stretch=4, target_lanes=1 << 30, carry_chunk=4)  # ...carried 4 stretches at a time
TILES = config(tile=16, tile_stretches=4)                        # C = 1, T >= 16: tiles of 16 steps

# (T, config, batch, C): one step; odd lengths on one stretch (a walk of 63 steps, no multiple of
# the unroll of 4) and on 13 stretches of 5 (the last of 3 steps); 41 stretches of 5 steps (the
# last of one) carried in 10 chunks of 4; forced stretches of 3 and 7 steps (shorter than the
# prefetch ring, and no power of two); 64-bit offsets.
SHAPES = [
    (1, ONE, (2,), 3),
    (63, ONE, (), 3),
    (63, FOURS, (2,), 2),
    (201, CHUNKS, (), 3),
    (5, config(stretch=3), (2,), 4),
    (37, config(stretch=7, wide_from=0), (2,), 3),
]
LAYOUTS = [(False, False), (True, True), (True, False)]  # (per_step, times)
# (prefetch, posterior_prefetch): the default, neither, both
PREFETCH = [(True, False), (False, False), (True, True)]

# Every shape with every parameter layout; dtype and prefetch in a Latin square over them.
CASES = [(T, cfg, batch, C, per_step, times, (torch.float64, torch.float32)[(i + j) % 2], PREFETCH[(i + 2 * j) % 3])
         for i, (T, cfg, batch, C) in enumerate(SHAPES) for j, (per_step, times) in enumerate(LAYOUTS)]


BITS = {torch.float64: "f64", torch.float32: "f32"}


def _ids(case):
    T, cfg, batch, C, per_step, times, dtype, (pf, ppf) = case
    ns = triton.plan(math.prod(batch), T, C, cfg)[0]
    return f"T{T}-ns{ns}-step{int(per_step)}-times{int(times)}-{BITS[dtype]}-pf{int(pf)}{int(ppf)}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_triton_equals_reference(case, poisoned):
    """The one-pass posterior forward (no gradients) against the reference: float64 to 1e-10,
    float32 within :data:`FLOAT32_BOUND`."""
    T, cfg, batch, C, per_step, times, dtype, (prefetch, posterior_prefetch) = case
    cfg = dataclasses.replace(cfg, prefetch=prefetch, posterior_prefetch=posterior_prefetch)
    rng = np.random.default_rng(100 * T + 10 * per_step + times)
    y, kw = random_problem(rng, T, C=C, batch=batch, per_step=per_step, times=times, missing=0.15,
                           offset=100.0 if dtype == torch.float32 else 0.0)
    ref = ks.filter(y, backend="reference", **kw)
    out = triton_filter(prepared(y, kw, dtype)[0], cfg)
    assert out.mean.dtype == dtype
    err, errs = posterior_error(out, ref)
    assert err < (1e-10 if dtype == torch.float64 else FLOAT32_BOUND), errs


@pytest.mark.parametrize("T, cfg", [(1, ONE), (63, ONE), (201, CHUNKS)], ids=["T1", "T63", "T201-41stretches"])
def test_walks_sum_the_loglik_over_time(T, cfg, poisoned):
    """The walks' log-likelihood summed over time in the kernel (each stretch in float64, the
    stretches after it) equals the sum of the per-step values they write, every stretch's partial
    sum written (poisoned buffers), with a batch and missing values."""
    rng = np.random.default_rng(T)
    y, kw = random_problem(rng, T, C=3, batch=(2,), missing=0.15)
    p = prepared(y, kw)[0]
    out = triton.filter(p, cfg)
    assert out["loglik"].shape == (2, 3)
    torch.testing.assert_close(out["loglik"], sum_time(out["logliks"]), rtol=1e-13, atol=1e-13)


def test_offsets_batch_broadcast_and_random_walk():
    """Data far from zero, parameters adding batch dimensions, a random-walk channel, irregular times,
    through :func:`kalmanscan.filter` (the default launch) and on stretches."""
    rng = np.random.default_rng(3)
    T = 37
    y = 1e4 + np.cumsum(rng.normal(size=(T, 2)), 0)
    y[5:9, 1] = np.nan
    kw = dict(theta=np.array([[[0.0, 0.3]], [[0.2, 1.5]]]), sigma=np.array([1.0, 0.4]),
              obs_var=0.5, mean=1e4, h=np.array([1.0, -2.0]), init_var=np.array([3.0, 0.5]),
              times=np.cumsum(rng.uniform(0.1, 2.0, T)))
    ref = ks.filter(y, backend="reference", **kw)
    kt = {k: torch.tensor(v, device=KERNEL_DEVICE) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    y_t = torch.tensor(y, device=KERNEL_DEVICE)
    for out in (ks.filter(y_t, backend="triton", **kt), triton_filter(prepare(y_t, **kt), FOURS)):
        assert out.mean.shape == (2, T, 2)
        err, errs = posterior_error(out, ref)
        assert err < 1e-10, errs


def test_half_precision_input_returns_its_dtype():
    rng = np.random.default_rng(4)
    y, kw = random_problem(rng, 20, missing=0.0)
    y16 = torch.tensor(y, dtype=torch.float16, device=KERNEL_DEVICE)
    out = ks.filter(y16, backend="triton", **kw)
    ref = ks.filter(y16.float(), backend="torch", **kw)
    assert out.mean.dtype == torch.float16
    torch.testing.assert_close(out.mean, ref.mean.half())


def _loss(post):
    return (post.loglik.sum() + (post.mean * 0.3).sum() + post.var.sum() + post.pred_mean.sum()
            + post.pred_var.sum())


@pytest.mark.parametrize("per_step,times,cfg", [(False, False, config(stretch=2)), (True, True, ONE)],
                         ids=["static-3stretches", "steps-times-one"])
def test_gradcheck_float64(per_step, times, cfg):
    """Finite differences of every input (``dt`` too where no times are given) through the fused
    forward and backward, on three stretches of 2 steps and on one of 6."""
    rng = np.random.default_rng(20 + per_step)
    y, kw = random_problem(rng, 6, C=2, batch=(1,), per_step=per_step, times=times, missing=0.15)
    t = problem_tensors(kw, grad=True, device=KERNEL_DEVICE)
    names = NAMES if times else NAMES + ("dt",)
    if not times:
        t["dt"].requires_grad_()
    fixed = {k: v for k, v in t.items() if k not in names}

    def f(y_t, *params):
        return _loss(triton_filter(prepare(y_t, **dict(zip(names, params)), **fixed), cfg))

    y_t = torch.tensor(y, requires_grad=True, device=KERNEL_DEVICE)
    assert torch.autograd.gradcheck(f, (y_t, *(t[k] for k in names)), atol=1e-6, rtol=1e-5, fast_mode=True)


# (T, config, batch, per_step, times): the autograd path (centred outputs, then the torch finish)
# and the backward walks on one stretch, on 13 stretches and in carry chunks of 4, on two
# stretches of one step, with 64-bit offsets, with and without the prefetch ring; every parameter
# layout once.
GRADIENT_CASES = [
    (23, config(prefetch=False), (2,), False, False),
    (63, FOURS, (2,), True, True),
    (63, config(min_stretch=4, target_lanes=1 << 30, carry_chunk=4, wide_from=0), (), True, False),
    (2, config(stretch=1), (2,), True, True),
]


@pytest.mark.parametrize("T,cfg,batch,per_step,times", GRADIENT_CASES,
                         ids=["one-static-noprefetch", "fours-steps-times", "chunks-wide-steps", "T2-ns2"])
def test_gradients_equal_torch_autograd(T, cfg, batch, per_step, times, poisoned):
    """Gradients of ``y`` and every parameter equal the torch backend's to 1e-10; the autograd
    path's forward equals the reference to 1e-10."""
    rng = np.random.default_rng(40 + T + 2 * per_step + times)
    y, kw = random_problem(rng, T, C=3, batch=batch, per_step=per_step, times=times, missing=0.15)
    weights = [torch.tensor(rng.normal(size=batch + (T, 3)), device=KERNEL_DEVICE) for _ in range(3)]
    grads = {}
    for backend in ("torch", "triton"):
        p, y_t, t = prepared(y, kw, grad=True)
        post = triton_filter(p, cfg) if backend == "triton" else ks.filter(y_t, backend="torch", **t)
        loss = sum((getattr(post, k) * w).sum() for k, w in zip(("mean", "var", "logliks"), weights))
        loss = loss + (post.pred_mean * post.pred_var).sum()
        grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in NAMES])
    err, errs = posterior_error(post, ks.filter(y, backend="reference", **kw))
    assert err < 1e-10, errs
    for name, a, b in zip(("y",) + NAMES, grads["torch"], grads["triton"]):
        assert torch.all(torch.isfinite(b)), name
        assert float((a - b).norm() / a.norm()) < 1e-10, name


def test_missing_values_give_zero_gradient():
    y = torch.tensor([[1.0], [float("nan")], [0.5]], dtype=torch.float64, requires_grad=True, device=KERNEL_DEVICE)
    theta = torch.tensor(0.4, dtype=torch.float64, requires_grad=True, device=KERNEL_DEVICE)
    ks.filter(y, theta=theta, sigma=1.0, obs_var=0.5, backend="triton").loglik.sum().backward()
    assert torch.isfinite(theta.grad) and y.grad[1, 0] == 0 and torch.all(torch.isfinite(y.grad))


@pytest.mark.parametrize("C,cfg", [(4, ONE), (4, FOURS), (1, TILES)], ids=["walk", "stretches", "tiles"])
def test_only_requested_outputs_are_written(C, cfg, poisoned):
    rng = np.random.default_rng(60)
    y, kw = random_problem(rng, 50, C=C, batch=())
    assert triton.uses_tiles(50, C, cfg) == (C == 1)
    p = prepare(torch.tensor(y, device=KERNEL_DEVICE), **kw)
    full = make_posterior(p, triton.filter(p, cfg))
    views = triton.kernel_views(p)
    init = torch.stack([1.0 / p.init_var.reshape(1, C),
                        (p.init_mean - p.mean[..., :1, :]).reshape(1, C) / p.init_var.reshape(1, C)], 1)
    out = triton.filter_forward(views, init, outputs=("mu",), config=cfg)
    assert set(out) == {"mu"}
    torch.testing.assert_close(out["mu"][0] + p.mean, full.mean, rtol=1e-12, atol=1e-12)


def test_plan_regimes():
    assert triton.plan(1, 32768, 4096) == (64, 512)
    assert triton.plan(1, 1 << 20, 64) == (4096, 256)
    assert triton.plan(1, 1 << 22, 1) == (ONE.max_stretches, 256)
    assert triton.plan(1, 63, 8) == (1, 63)
    assert triton.plan(2, 10, 3, config(stretch=4)) == (3, 4)
    assert triton.plan(2, 63, 2, FOURS) == (13, 5)
    assert triton.plan(1, 201, 3, CHUNKS) == (41, 5)


def test_plan_walks_one_stretch_rather_than_two():
    # a split into fewer than min_stretches stretches is not worth its aggregate pass
    assert triton.plan(1, 1024, 131072) == (1, 1024)
    assert triton.plan(2, 4096, 65536) == (1, 4096)
    assert triton.plan(1, 2048, 65536) == (4, 512)
    assert triton.plan(1, 8, 3, FOURS) == (1, 8)
    assert triton.plan(1, 12, 3, FOURS) == (3, 4)
    assert triton.plan(1, 8, 3, config(min_stretch=4, target_lanes=1 << 30, min_stretches=1)) == (2, 4)


def test_config_refuses_bad_values():
    for bad in (dict(stretch=0), dict(min_stretch=0), dict(min_stretches=0), dict(carry_chunk=1.5),
                dict(tile=16, tile_row=3)):
        with pytest.raises(ValueError):
            config(**bad)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        ks.filter(torch.zeros(3, 1), theta=1.0, sigma=1.0, obs_var=1.0, backend="triton")


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_inf_in_y_is_refused_after_the_kernels(value):
    """The fused path looks for inf only when the log-likelihood is non-finite: still a ValueError."""
    y = torch.randn(40, 3, dtype=torch.float64, device=KERNEL_DEVICE)
    y[17, 1] = value
    y[5, 2] = math.nan
    with pytest.raises(ValueError, match="y must be finite or NaN"):
        ks.filter(y, backend="triton", theta=0.1, sigma=1.0, obs_var=0.5)
    with pytest.raises(ValueError, match="y must be finite or NaN"):
        ks.filter(y, backend="torch", theta=0.1, sigma=1.0, obs_var=0.5)


def test_summary_kernels_equal_torch_products():
    """:func:`triton.summary` (aggregate, then the total over 11 chunks of 4 of 41 stretches)
    against the torch backend's chunked products, as projective maps."""
    rng = np.random.default_rng(11)
    y, kw = random_problem(rng, 201, C=3, batch=(2,), per_step=True, times=False, missing=0.15)
    p = prepare(torch.tensor(y, device=KERNEL_DEVICE), backend="triton", **problem_tensors(kw, device=KERNEL_DEVICE))
    got = torch.stack(triton.summary(p, CHUNKS))
    want = torch.stack(torch_backend.summary(p))
    got, want = got / (got[0] + got[3]), want / (want[0] + want[3])  # the maps act projectively
    assert float((got - want).abs().max()) < 1e-12


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_process_noise_stays_finite(backend):
    """sigma = 0 with decay < 1: the exact precision grows like decay^(-2t) past float32's range
    (about 440 steps here); both backends must return the exact, finite answer (triton hands such
    a problem to the torch backend)."""
    rng = np.random.default_rng(5)
    y = rng.normal(size=(1000, 3))
    y[rng.random(y.shape) < 0.1] = np.nan
    kw = dict(theta=np.array([1.0, 0.1, 0.0]), sigma=0.0, obs_var=0.7, init_var=2.0, mean=0.5)
    ref = ks.filter(y, backend="reference", **kw)
    out = ks.filter(torch.tensor(y, dtype=torch.float32, device=KERNEL_DEVICE), backend=backend,
                    **{k: torch.tensor(v, dtype=torch.float32, device=KERNEL_DEVICE) for k, v in kw.items()})
    for name in ("mean", "var", "pred_mean", "pred_var", "logliks"):
        got = getattr(out, name).double().cpu().numpy()
        want = np.asarray(getattr(ref, name))
        assert np.isfinite(got).all(), name
        assert np.abs(got - want).max() <= 4e-6 * max(np.abs(want).max(), 1.0), name


# Time-parallel forward (tiles of 16 steps, at most 4 stretches of them): (T, tile_row, per_step,
# times, dtype). One tile; two tiles, the second of one step; 4 tiles in 4 stretches (the last
# partial); 7 tiles in 4 stretches of 2 (the last of one tile of 5 steps); 9 tiles in 3 stretches
# of 3 (the last tile of 3 steps, mid-row). Rows of 1 to 16 steps (16 rows of one step up to one
# row of the whole tile), T no multiple of the row; every layout and both dtypes in a Latin square.
# A program walks at most 64 steps in sequence (3 tiles of rows of 8: composed, then walked).
TILE_CASES = [
    (16, 1, False, False, torch.float64),
    (16, 16, True, True, torch.float32),
    (17, 2, True, True, torch.float64),
    (17, 8, True, False, torch.float32),
    (63, 4, True, False, torch.float64),
    (63, 8, False, False, torch.float32),
    (101, 16, True, False, torch.float64),
    (131, 2, False, False, torch.float32),
    (131, 8, True, True, torch.float64),
]


@pytest.mark.parametrize("T,row,per_step,times,dtype", TILE_CASES,
                         ids=[f"T{c[0]}-row{c[1]}-step{int(c[2])}-times{int(c[3])}-{BITS[c[4]]}" for c in TILE_CASES])
def test_time_parallel_forward_equals_reference(T, row, per_step, times, dtype, poisoned):
    cfg = config(tile=16, tile_stretches=4, tile_row=row)
    assert triton.uses_tiles(T, 1, cfg)
    rng = np.random.default_rng(700 + T + 10 * per_step + times + 100 * row)
    y, kw = random_problem(rng, T, C=1, batch=(2,), per_step=per_step, times=times, missing=0.15)
    ref = ks.filter(y, backend="reference", **kw)
    out = triton_filter(prepared(y, kw, dtype)[0], cfg)
    err, errs = posterior_error(out, ref)
    assert err < (1e-10 if dtype == torch.float64 else FLOAT32_BOUND), errs


def test_time_parallel_plan():
    assert triton.tile_plan(16, TILES) == (1, 1)
    assert triton.tile_plan(17, TILES) == (2, 1)
    assert triton.tile_plan(131, TILES) == (3, 3)   # 9 tiles: 3 stretches of 3
    assert triton.tile_plan(201, TILES) == (4, 4)   # 13 tiles: 4 stretches of 4 (the last of 1)
    assert triton.tile_plan(1000, TILES) == (4, 16)
    assert TILES.tile % TILES.tile_row == 0 and TILES.tile_row & (TILES.tile_row - 1) == 0
    assert not triton.uses_tiles(15, 1, TILES) and not triton.uses_tiles(64, 2, TILES)
    assert not triton.uses_tiles(64, 1, config(tile=16, stretch=8))


@pytest.mark.parametrize("T", [37, 63])
def test_time_parallel_gradients_equal_torch_autograd(T, poisoned):
    """The autograd path's forward (centred outputs only) on tiles, its backward on walks of about
    16 steps (``tile_bwd`` off; tests/ops/filter/test_triton_backward.py runs it on tiles)."""
    cfg = config(tile=16, tile_stretches=4, tile_bwd=False, min_stretch=16, target_lanes=1 << 30)
    rng = np.random.default_rng(80 + T)
    y, kw = random_problem(rng, T, C=1, per_step=True, times=True, missing=0.15)
    grads = {}
    for backend in ("torch", "triton"):
        p, yt, t = prepared(y, kw, grad=True)
        post = triton_filter(p, cfg) if backend == "triton" else ks.filter(yt, backend="torch", **t)
        grads[backend] = torch.autograd.grad(_loss(post), [yt] + [t[k] for k in NAMES])
    for name, a, b in zip(("y",) + NAMES, grads["torch"], grads["triton"]):
        assert float((a - b).norm() / a.norm()) < 1e-10, name


@pytest.mark.gpu
@pytest.mark.parametrize("T,C,batch", [(4096, 64, (4,)), (1 << 16, 1, (2,)), (333, 5, (3, 2))])
def test_compiled_kernels_equal_reference_on_cuda(T, C, batch):
    """The compiled kernels on a GPU at the default launch (many stretches, tiles, carry chunks)
    against the float64 reference: float64 to 1e-10, float32 within :data:`FLOAT32_BOUND`, and
    float64 gradients against the torch backend's."""
    rng = np.random.default_rng(T + C)
    y, kw = random_problem(rng, T, C=C, batch=batch, per_step=C > 1, times=C == 1, missing=0.15)
    ref = ks.filter(y, backend="reference", **kw)
    cuda = {k: v.cuda() for k, v in problem_tensors(kw).items()}
    for dtype, bound in ((torch.float64, 1e-10), (torch.float32, FLOAT32_BOUND)):
        out = ks.filter(torch.tensor(y, dtype=dtype).cuda(), backend="triton",
                        **{k: v if k == "times" else v.to(dtype) for k, v in cuda.items()})
        err, errs = posterior_error(out, ref)
        assert err < bound, errs
    grads = {}
    for backend in ("torch", "triton"):
        t = {k: v.clone().requires_grad_(k in NAMES) for k, v in cuda.items()}
        y_t = torch.tensor(y).cuda().requires_grad_()
        grads[backend] = torch.autograd.grad(_loss(ks.filter(y_t, backend=backend, **t)), [y_t] + [t[k] for k in NAMES])
    for name, a, b in zip(("y",) + NAMES, grads["torch"], grads["triton"]):
        assert float((a - b).norm() / a.norm()) < 1e-10, name


THETA_DT = np.array([1e-8, 3e-5, 1e-4, 0.3, 30.0, 1e3])
OBS_VAR = np.array([1e-8, 1e-3, 1.0, 1e4, 1e8])
MOMENTS = ("var", "precision", "pred_var", "pred_precision", "pred_obs_var", "mean", "pred_mean")


@pytest.mark.parametrize("missing,init_var", [(0.0, 1e-6), (0.2, 1e6)])
def test_extreme_parameters_float32(missing, init_var):
    """theta dt from 1e-8 to 1e3 (decay underflows), obs_var from 1e-8 to 1e8, initial precision far
    above and below the fixed point: the walks in float32 within
    :data:`FLOAT32_BOUND` of the float64 reference on every moment (measured on an H200: 3.2e-6,
    the growth from the vague prior multiplying the decay's rounding, docs/math.md §8)."""
    rng = np.random.default_rng(3)
    y = rng.normal(size=(len(THETA_DT), 33, len(OBS_VAR))) * np.sqrt(OBS_VAR)
    y[rng.random(y.shape) < missing] = np.nan
    kw = dict(theta=(THETA_DT / 0.7)[:, None, None], sigma=2.0, obs_var=OBS_VAR, dt=0.7, init_var=init_var)
    ref = ks.filter(y, backend="reference", **kw)
    p = prepare(torch.tensor(y, dtype=torch.float32, device=KERNEL_DEVICE),
                **{k: torch.tensor(v, dtype=torch.float32, device=KERNEL_DEVICE) if isinstance(v, np.ndarray) else v
                   for k, v in kw.items()})
    out = triton_filter(p, ONE)
    errs = {k: (rel_error if k in POSITIVE else max_rel_error)(getattr(out, k), getattr(ref, k)) for k in MOMENTS}
    assert max(errs.values()) < FLOAT32_BOUND, errs
