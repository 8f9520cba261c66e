"""The triton backend's derived Posterior fields: one kernel pass
(:mod:`kalmanscan.kernels.filter.derive`, under ``TRITON_INTERPRET=1`` on the CPU) against the
derivation's torch operations (:func:`kalmanscan.inference.derived.torch_fields`) on random
non-zero moments, and through ``ks.filter`` / ``ks.smooth`` against the reference backend.

Odd lengths (1, 63, 1000), gaps, batches, per-step parameters and times, a diffuse prior, the
smoother's centred problem, float32 and float64; every buffer the wrappers allocate starts as NaN
(``poisoned``), and a call asking for some fields gets those alone.
"""

import numpy as np
import pytest
import torch
from helpers import FIELDS, FLOAT32_BOUND, KERNEL_DEVICE, prepared, problem_tensors, random_problem, to_np

import kalmanscan as ks
from kalmanscan.inference import derived
from kalmanscan.inference.smoothing import centre
from kalmanscan.ops.filter.triton import derive

TOL = {torch.float64: 1e-12, torch.float32: FLOAT32_BOUND}
"""Relative and absolute tolerance against the torch operations (the same arithmetic: under the
interpreter equal but for float32 ``log`` in its last bit; on the GPU fused multiply-adds and
float32's ``div.full`` and ``log``)."""


def moments(p, seed):
    """Random non-zero filtered moments of ``p``'s shape and dtype (variances in ``[0.1, 2.1)``)."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(p.shape, dtype=torch.float64, generator=g) * 2 + 0.5
    var = torch.rand(p.shape, dtype=torch.float64, generator=g) * 2 + 0.1
    return mean.to(p.dtype).to(p.y.device), var.to(p.dtype).to(p.y.device)


def assert_fields_close(post, ref, names, tol):
    """Each field of ``post`` equals ``ref``'s: the same infinite entries (a diffuse window's) and the
    finite ones within ``tol`` of the field's largest finite magnitude."""
    for k in names:
        a, r = to_np(getattr(post, k)), to_np(getattr(ref, k))
        finite = np.isfinite(r)
        np.testing.assert_array_equal(a[~finite], r[~finite], err_msg=k)
        scale = max(np.max(np.abs(r[finite]), initial=0.0), 1e-300)
        assert np.max(np.abs(a[finite] - r[finite]), initial=0.0) <= tol * scale, k


@pytest.fixture
def launches(monkeypatch):
    """The fields each call of the kernel's wrapper wrote."""
    calls = []
    run = derive.derived_fields

    def spy(*args, **kwargs):
        out = run(*args, **kwargs)
        calls.append(tuple(out))
        return out

    monkeypatch.setattr(derive, "derived_fields", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("T, per_step, times", [(1, False, False), (63, True, False), (1000, False, True)],
                         ids=["T1", "T63-per-step", "T1000-times"])
def test_kernel_equals_the_torch_derivation(T, per_step, times, dtype, poisoned):
    rng = np.random.default_rng(T)
    y, kw = random_problem(rng, T, C=3, batch=(2,), per_step=per_step, missing=0.15, times=times)
    p = prepared(y, kw, dtype)[0]
    mean, var = moments(p, T)
    want = derived.torch_fields(p, mean, var)
    got = derive.derived_fields(p, mean, var)
    assert tuple(got) == derive.FIELDS
    for k in derive.FIELDS:
        assert got[k].dtype == dtype and got[k].is_contiguous()
        torch.testing.assert_close(got[k], want[k], rtol=TOL[dtype], atol=TOL[dtype], msg=k)


@pytest.mark.parametrize("fields", [("pred_var",), ("logliks", "missing"), ("precision", "pred_obs_mean")])
def test_only_the_fields_asked_for(fields, poisoned):
    """Each subset of fields (its inputs alone read) equals the same fields of a full pass."""
    rng = np.random.default_rng(7)
    y, kw = random_problem(rng, 63, C=5, batch=(), missing=0.2)
    p = prepared(y, kw)[0]
    mean, var = moments(p, 7)
    want = derive.derived_fields(p, mean, var)
    got = derive.derived_fields(p, mean, var, fields)
    assert tuple(got) == fields
    for k in fields:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_centred_problem_and_broadcast_moments(poisoned):
    """The smoother's centred problem (``y - h m``, an OU mean of 0 as a ``(1, 1)`` tensor) with
    the moments given as broadcast views: the torch operations' values."""
    rng = np.random.default_rng(3)
    y, kw = random_problem(rng, 63, C=3, batch=(2,), missing=0.1, offset=50.0)
    p = prepared(y, kw)[0]
    centred = centre(p)
    mean, var = moments(p, 3)
    var = var[:1].expand(p.shape)
    want = derived.torch_fields(centred, mean, var)
    got = derive.derived_fields(centred, mean, var)
    for k in derive.FIELDS:
        torch.testing.assert_close(got[k], want[k], rtol=TOL[torch.float64], atol=TOL[torch.float64], msg=k)


@pytest.mark.parametrize("case", ["plain", "diffuse", "per-step-f32"])
def test_filter_fields_read_through_the_kernel(case, launches):
    """``ks.filter(..., backend="triton")``: every field read comes from one launch of the kernel
    writing the fields asked for, equal to the reference's (float64 to 1e-10, float32 within
    :data:`FLOAT32_BOUND` on data offset from zero); a diffuse channel's window as the reference's."""
    dtype = torch.float32 if case.endswith("f32") else torch.float64
    rng = np.random.default_rng(11)
    y, kw = random_problem(rng, 63, C=3, batch=(2,), per_step=case.startswith("per-step"), missing=0.15,
                           offset=100.0 if dtype == torch.float32 else 0.0)
    if case == "diffuse":
        kw["init_var"][:, 1] = np.inf
        y[:5, 0, 1] = np.nan  # its first observation at step 5 in the first series
    ref = ks.filter(y, backend="reference", **kw)
    y_t = torch.tensor(y, dtype=dtype, device=KERNEL_DEVICE)
    post = ks.filter(y_t, backend="triton", **problem_tensors(kw, dtype, device=KERNEL_DEVICE))
    assert_fields_close(post, ref, FIELDS, 1e-10 if dtype == torch.float64 else FLOAT32_BOUND)
    assert launches == [(*derive.FIELDS,)]
    partial = ks.filter(y_t, backend="triton", outputs=("mean", "pred_var"), **problem_tensors(kw, dtype,
                                                                                              device=KERNEL_DEVICE))
    assert partial.logliks is None   # the kernel built for pred_var alone: the same bound, not the same bits
    assert_fields_close(partial, ref, ("pred_var",), 1e-10 if dtype == torch.float64 else FLOAT32_BOUND)
    assert launches[1:] == [("pred_var",)]


def test_smoother_takes_its_predictions_from_the_kernel(launches):
    """``ks.smooth`` on a diffuse problem: the smoother's predictions (the derivation on its centred
    problem, the two fields it reads) and the filtered fields come from the kernel, the result
    equals the reference's."""
    rng = np.random.default_rng(5)
    y, kw = random_problem(rng, 63, C=3, batch=(2,), missing=0.15)
    kw["init_var"][0, 2] = np.inf
    ref = ks.smooth(y, backend="reference", **kw)
    post = ks.smooth(torch.tensor(y, device=KERNEL_DEVICE), backend="triton",
                     **problem_tensors(kw, device=KERNEL_DEVICE))
    assert_fields_close(post, ref, ("mean", "var", "precision"), 1e-10)
    assert_fields_close(post.filtered, ref.filtered, FIELDS, 1e-10)
    assert launches == [("pred_mean", "pred_var"), derive.FIELDS]  # the smoother's two, then the filtered fields


def test_gradients_keep_the_torch_operations(launches):
    """With a parameter needing a gradient the fields come from the torch operations (no launch),
    and their gradient equals the torch backend's."""
    rng = np.random.default_rng(2)
    y, kw = random_problem(rng, 31, C=2, batch=(), missing=0.1)
    grads = []
    for backend in ("triton", "torch"):
        t = problem_tensors(kw, device=KERNEL_DEVICE, grad=True)
        post = ks.filter(torch.tensor(y, device=KERNEL_DEVICE), backend=backend, **t)
        loss = (post.pred_mean * post.pred_precision).sum() + post.logliks.sum()
        grads.append(torch.autograd.grad(loss, [t["theta"], t["obs_var"]]))
    assert launches == []
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
