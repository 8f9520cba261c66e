"""The lean default call on the triton backend (kernels under TRITON_INTERPRET=1 on the CPU): the
kernels write the filtered mean and variance and sum the log-likelihood over time without writing
its per-step terms; every other Posterior field is derived when read
(:mod:`kalmanscan.inference.derived`). Each field is compared with the reference backend's, the
log-likelihood's sum and its gradient with the torch backend's and by gradcheck in float64.

Odd lengths (1, 63, 1000), missing values, batches; several stretches and blocks of lanes, a carry
in chunks and the time-parallel tiles through backends registered with small launch
configurations; every buffer the wrappers allocate starts as NaN (``poisoned``).
"""

import dataclasses
import functools
import types

import numpy as np
import pytest
import torch
from helpers import (FIELDS, FLOAT32_BOUND, KERNEL_DEVICE, NAMES, config, posterior_error, prepared,
                     problem_tensors, random_problem)

import kalmanscan as ks
from kalmanscan.ops.filter import dispatch
from kalmanscan.ops.filter.triton import backend as triton
from kalmanscan.ops.filter.triton import library
from kalmanscan.ops.filter.triton.walks import LOGLIK_SUM

LEAN = ("mean", "var", "loglik")
FOURS = config(min_stretch=4, target_lanes=1 << 30)                  # stretches of 4 to 7 steps
CHUNKS = config(min_stretch=4, target_lanes=1 << 30, carry_chunk=4)  # ...carried 4 stretches at a time
TILES = config(tile=16, tile_stretches=4)                            # C = 1: tiles of 16 steps, 4 stretches
LAUNCHES = {"fours": FOURS, "chunks": CHUNKS, "tiles": TILES}


@pytest.fixture
def launched():
    """``backend=name`` runs the triton backend with the launch ``LAUNCHES[name]`` (registered for
    the test, removed after it)."""
    for name, cfg in LAUNCHES.items():
        module = types.ModuleType(f"triton_{name}")
        module.filter = functools.partial(triton.filter, config=cfg)
        module.smooth = functools.partial(triton.smooth, config=cfg)
        module.SUMS_LOGLIK = triton.SUMS_LOGLIK
        dispatch.register_backend(name, module)
    yield
    for name in LAUNCHES:
        dispatch.unregister_backend(name)


@pytest.fixture
def asked(monkeypatch):
    """The outputs each call asks of the triton backend and the fields its result holds."""
    calls = []
    run = triton.filter

    def spy(p, *args, **kwargs):
        out = run(p, *args, **kwargs)
        calls.append((p.outputs, set(out)))
        return out

    monkeypatch.setattr(triton, "filter", spy)
    return calls


def _tensors(y, kw, dtype=torch.float64, grad=False):
    t = problem_tensors(kw, dtype, grad=grad, device=KERNEL_DEVICE)
    return torch.tensor(y, dtype=dtype, requires_grad=grad, device=KERNEL_DEVICE), t


@pytest.mark.parametrize("T, C, batch, per_step", [(1, 3, (2,), False), (63, 3, (2,), True), (1000, 3, (), False)],
                         ids=["T1", "T63-per-step", "T1000-15stretches"])
def test_default_call_writes_moments_and_sums_loglik(T, C, batch, per_step, poisoned, asked):
    """The default ``ks.filter`` on the triton backend (its default launch) asks for the mean,
    variance and the log-likelihood's sum, gets no per-step terms back, and every field equals
    the reference's to float64 rounding."""
    rng = np.random.default_rng(T)
    y, kw = random_problem(rng, T, C=C, batch=batch, per_step=per_step, missing=0.15)
    ref = ks.filter(y, backend="reference", **kw)
    y_t, t = _tensors(y, kw)
    post = ks.filter(y_t, backend="triton", **t)
    assert [outputs for outputs, _ in asked] == [LEAN]
    assert asked[0][1] >= set(LEAN) and "logliks" not in asked[0][1]
    err, errs = posterior_error(post, ref, FIELDS)
    assert err < 1e-10, errs


@pytest.mark.parametrize("name, T, C, dtype", [("fours", 63, 2, torch.float64), ("chunks", 201, 3, torch.float64),
                                               ("tiles", 63, 1, torch.float64), ("fours", 63, 2, torch.float32),
                                               ("tiles", 63, 1, torch.float32)],
                         ids=["fours-f64", "chunks-f64", "tiles-f64", "fours-f32", "tiles-f32"])
def test_default_call_on_stretches_and_tiles(name, T, C, dtype, poisoned, launched):
    """The default call across many stretches (13 of 4 to 7 steps; 41 carried 4 at a time) and on
    the tiles, every field against the reference: float64 to 1e-10, float32 within
    :data:`FLOAT32_BOUND` (data offset from zero, as the float32 tests of the triton forward)."""
    rng = np.random.default_rng(T + C)
    y, kw = random_problem(rng, T, C=C, batch=(2,), missing=0.15,
                           offset=100.0 if dtype == torch.float32 else 0.0)
    ref = ks.filter(y, backend="reference", **kw)
    y_t, t = _tensors(y, kw, dtype)
    post = ks.filter(y_t, backend=name, **t)
    assert post.mean.dtype == post.loglik.dtype == dtype
    err, errs = posterior_error(post, ref, FIELDS)
    assert err < (1e-10 if dtype == torch.float64 else FLOAT32_BOUND), errs


@pytest.mark.parametrize("cfg", [FOURS, TILES], ids=["walks", "tiles"])
def test_kernel_sum_equals_the_per_step_terms(cfg, poisoned):
    """The kernels' sum alone (no per-step terms written) equals the sum of the terms they write
    when asked for them, on the walks and on the tiles; asked for both, the sum comes too."""
    rng = np.random.default_rng(5)
    y, kw = random_problem(rng, 63, C=1 if cfg is TILES else 3, batch=(2,), missing=0.15)
    p = prepared(y, kw)[0]
    lean = triton.filter(dataclasses.replace(p, outputs=LEAN), cfg)
    full = triton.filter(dataclasses.replace(p, outputs=("mean", "var", "logliks", "loglik")), cfg)
    assert "logliks" not in lean and lean["loglik"].shape == (2, p.shape[-1])
    want = full["logliks"].sum(-2, dtype=torch.float64)
    torch.testing.assert_close(lean["loglik"], want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(full["loglik"], want, rtol=1e-13, atol=1e-13)


def test_loglik_gradient_matches_torch_backend(launched):
    """The gradient of the lean call's log-likelihood sum (and of its mean and variance) with
    respect to ``y`` and every parameter, across stretches, equals the torch backend's."""
    rng = np.random.default_rng(11)
    y, kw = random_problem(rng, 63, C=2, batch=(2,), missing=0.15)
    grads = {}
    for backend in ("fours", "torch"):
        y_t, t = _tensors(y, kw, grad=True)
        post = ks.filter(y_t, backend=backend, **t)
        loss = post.loglik.sum() + (post.mean * post.var).sum()
        leaves = [y_t] + [t[k] for k in NAMES]
        grads[backend] = torch.autograd.grad(loss, leaves)
    for k, a, b in zip(("y",) + tuple(NAMES), *grads.values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=k)


def test_loglik_gradcheck():
    """gradcheck of the lean call's log-likelihood sum in float64 (a few steps with a gap; fast
    mode: the Jacobian checked along random directions)."""
    rng = np.random.default_rng(2)
    y, kw = random_problem(rng, 6, C=2, batch=(), missing=0.0)
    y[2, 1] = np.nan
    y_t, t = _tensors(y, kw, grad=True)
    names = ("theta", "sigma", "obs_var", "mean", "h")

    def loglik(y_in, *params):
        return ks.filter(y_in, backend="triton", **{**t, **dict(zip(names, params))}).loglik

    assert torch.autograd.gradcheck(loglik, (y_t, *(t[k] for k in names)), fast_mode=True)


def test_per_step_terms_still_written_when_asked(poisoned):
    """A call naming ``"logliks"`` (the likelihood objective's) gets the per-step terms from the
    kernels, and ``outputs=("loglik",)`` both the sum and the per-step terms."""
    rng = np.random.default_rng(8)
    y, kw = random_problem(rng, 63, C=3, batch=(2,), missing=0.15)
    ref = ks.filter(y, backend="reference", **kw)
    p = prepared(y, kw)[0]
    out = triton.filter(dataclasses.replace(p, outputs=("logliks",)))
    np.testing.assert_allclose(out["logliks"].cpu().numpy(), ref.logliks, rtol=1e-10, atol=1e-12)
    y_t, t = _tensors(y, kw)
    post = ks.filter(y_t, backend="triton", outputs=("loglik",), **t)
    np.testing.assert_allclose(post.logliks.cpu().numpy(), ref.logliks, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(post.loglik.cpu().numpy(), ref.loglik, rtol=1e-10, atol=1e-12)


def test_operator_returns_the_sum():
    """The compiled path's operator with the ``"loglik"`` bit returns the sum ``(..., C)`` after
    the fields (opcheck: schema and fake tensor shapes), equal to the eager forward's."""
    rng = np.random.default_rng(9)
    y, kw = random_problem(rng, 9, C=3, batch=(2,), missing=0.15)
    p = prepared(y, kw)[0]
    inputs = tuple(getattr(p, k).expand(p.shape) for k in ("y", "theta", "sigma", "dt", "obs_var", "mean", "h"))
    mask = triton.posterior_mask(LEAN)
    assert mask & LOGLIK_SUM and not mask & (1 << triton.POSTERIOR.index("logliks"))
    args = (*inputs, triton.initial_state(p), list(p.shape), triton.DEFAULT_CONFIG.as_ints(), mask)
    torch.library.opcheck(library.filter_posterior, args, test_utils=("test_schema", "test_faketensor"))
    mean, var, loglik = library.filter_posterior(*args)
    assert loglik.shape == (2, 3)
    eager = triton.filter(dataclasses.replace(p, outputs=LEAN))
    torch.testing.assert_close(loglik, eager["loglik"], rtol=0, atol=0)
    torch.testing.assert_close(mean, eager["mean"], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1000, 64), (5000, 1)], ids=["walks-15stretches", "tiles"])
def test_default_call_on_the_gpu(shape, asked):
    """The compiled kernels: the default call asks for the lean outputs, gets no per-step terms,
    and every field equals the reference's (float64), on the walks and on the tiles."""
    rng = np.random.default_rng(4)
    y, kw = random_problem(rng, shape[-2], C=shape[-1], batch=shape[:-2], missing=0.05)
    ref = ks.filter(y, backend="reference", **kw)
    t = problem_tensors(kw, torch.float64, device="cuda")
    post = ks.filter(torch.tensor(y, device="cuda"), backend="triton", **t)
    assert [outputs for outputs, _ in asked] == [LEAN] and "logliks" not in asked[0][1]
    err, errs = posterior_error(post, ref, FIELDS)
    assert err < 1e-10, errs
