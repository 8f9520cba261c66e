"""The triton backend's RTS smoother (``kernels/filter/rts.py`` under TRITON_INTERPRET=1) against
the float64 sequential smoother and the torch reverse scans: odd lengths, many stretches and carry
chunks, static and per-step parameters, NaN-poisoned outputs; each lane walks at most ~64 steps."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import (FLOAT32_BOUND, KERNEL_DEVICE, NAMES, config, posterior_error, prepared, problem_tensors,
                     random_problem, triton_smooth)

import kalmanscan as ks
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter.triton import backend as triton

ONE = config()
# stretches of about 4 steps, the carry scan in chunks of 4 stretches
CHUNKS = config(min_stretch=4, target_lanes=1 << 30, carry_chunk=4)

# (T, config, per_step, times, dtype): one step; two stretches of one step; odd lengths on one
# stretch (63) and on 13 stretches (the last of 3 steps), 41 of 5 steps in 10 carry chunks (201);
# every length and configuration with static and per-step parameters in turn, float32 on half;
# 64-bit offsets once.
CASES = [
    (1, ONE, False, False, torch.float64),
    (2, config(stretch=1), True, True, torch.float32),
    (2, ONE, False, False, torch.float32),
    (63, ONE, True, True, torch.float64),
    (63, CHUNKS, False, False, torch.float64),
    (63, CHUNKS, True, True, torch.float32),
    (201, CHUNKS, True, True, torch.float64),
    (201, dataclasses.replace(CHUNKS, wide_from=0), False, False, torch.float32),
]


@pytest.mark.parametrize("T,cfg,per_step,times,dtype", CASES,
                         ids=[f"T{c[0]}-ns{triton.plan(2, c[0], 3, c[1])[0]}-step{int(c[2])}-f{str(c[4])[-2:]}"
                              for c in CASES])
def test_fused_smoother_equals_reference(T, cfg, per_step, times, dtype, poisoned):
    rng = np.random.default_rng(900 + T + 10 * per_step)
    y, kw = random_problem(rng, T, C=3, batch=(2,), per_step=per_step, times=times, missing=0.15,
                           offset=20.0)
    ref = ks.smooth(y, backend="reference", **kw)
    out = triton_smooth(prepared(y, kw, dtype)[0], cfg)
    assert out.mean.dtype == dtype
    err, errs = posterior_error(out, ref, fields=("mean", "var", "precision"))
    assert err < (1e-10 if dtype == torch.float64 else FLOAT32_BOUND), errs


def test_smooth_through_ks_smooth():
    """:func:`kalmanscan.smooth` with ``backend="triton"`` (the default launch) equals the reference."""
    rng = np.random.default_rng(901)
    y, kw = random_problem(rng, 23, C=2, per_step=True, times=True, missing=0.2)
    ref = ks.smooth(y, backend="reference", **kw)
    out = ks.smooth(torch.tensor(y, device=KERNEL_DEVICE), backend="triton",
                    **problem_tensors(kw, device=KERNEL_DEVICE))
    err, errs = posterior_error(out, ref, fields=("mean", "var", "precision"))
    assert err < 1e-10, errs
    err, errs = posterior_error(out.filtered, ref.filtered)
    assert err < 1e-10, errs


@pytest.mark.parametrize("cfg", [ONE, CHUNKS], ids=["one", "chunks"])
def test_rts_kernels_equal_torch_scans_on_arbitrary_inputs(cfg, poisoned):
    """The kernels against the torch backend's reverse scans on random positive variances and means
    (not a filter's output), with broadcast static decay and noise and a per-step mean parameter."""
    g = torch.Generator().manual_seed(3)
    B, T, C = 2, 37, 5
    f = {"mean": torch.randn(B, T, C, generator=g, dtype=torch.float64),
         "var": 0.1 + torch.rand(B, T, C, generator=g, dtype=torch.float64),
         "pred_mean": torch.randn(B, T, C, generator=g, dtype=torch.float64),
         "pred_var": 1.0 + torch.rand(B, T, C, generator=g, dtype=torch.float64),
         "decay": 0.5 + 0.5 * torch.rand(1, 1, C, generator=g, dtype=torch.float64),
         "noise": 0.1 + torch.rand(1, 1, C, generator=g, dtype=torch.float64)}
    # on the kernels' device before the broadcast: decay and noise keep their zero strides
    f = {k: v.to(KERNEL_DEVICE).expand(B, T, C) for k, v in f.items()}
    m = torch.randn(1, T, 1, generator=g, dtype=torch.float64).to(KERNEL_DEVICE).expand(B, T, C)
    mean_s, var_s, prec_s = triton.smooth(f, m, cfg)
    want_mean, want_var, _ = torch_backend.smooth(f, m)
    torch.testing.assert_close(mean_s, want_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var_s, want_var, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(prec_s, 1.0 / want_var, rtol=1e-12, atol=1e-12)


def test_smoother_gradients_equal_torch_autograd():
    """With gradients the smoother's reverse scans run in torch, through the triton filter's
    autograd (here on stretches of 4 steps): the gradients of every parameter equal the torch
    backend's."""
    rng = np.random.default_rng(50)
    y, kw = random_problem(rng, 23, C=2, per_step=True, times=True, missing=0.2)
    grads = {}
    for backend in ("torch", "triton"):
        p, y_t, t = prepared(y, kw, grad=True)
        post = triton_smooth(p, config(stretch=4)) if backend == "triton" else ks.smooth(y_t, backend="torch", **t)
        grads[backend] = torch.autograd.grad((post.mean * 0.7 + post.var).sum(), [t[k] for k in NAMES])
    for name, a, b in zip(NAMES, grads["torch"], grads["triton"]):
        assert float((a - b).norm() / a.norm()) < 1e-10, name


def test_smoother_gradients_still_flow_through_ks_smooth():
    """Through :func:`kalmanscan.smooth` on the triton backend (the default launch)."""
    rng = np.random.default_rng(8)
    y, kw = random_problem(rng, 12, C=1, per_step=False)
    theta = torch.tensor(kw.pop("theta"), requires_grad=True, device=KERNEL_DEVICE)
    post = ks.smooth(torch.tensor(y, device=KERNEL_DEVICE), backend="triton", theta=theta,
                     **problem_tensors(kw, device=KERNEL_DEVICE))
    (g,) = torch.autograd.grad(post.mean.sum() + post.var.sum(), [theta])
    assert torch.isfinite(g).all() and float(g.abs().sum()) > 0
