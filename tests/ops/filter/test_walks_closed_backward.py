"""The walks' backward with the precision in closed form: where the forward's aggregate pass took a
stretch's first ``done`` steps in closed form (``filter_forward(..., closed_steps=True)["done"]``),
the backward computes the precision of those steps (docs/math.md §9) instead of reading the saved
``lam``. Against the same backward reading ``lam`` throughout (``done=None``), and through
``ks.filter`` against float64 torch autograd. Opt-in (``FilterConfig.bwd_closed``) until timed on a
GPU (``benchmarks/closed_bwd.py``).

Eight channels and programs of eight lanes, so each program is one stretch: the first and a partial
last one read ``lam``, the others take the closed form up to the first chunk with a missing value.
"""

import numpy as np
import pytest
import torch
from helpers import FLOAT32_BOUND, KERNEL_DEVICE, NAMES, array_tensors, config, max_rel_error, prepared, random_problem

import kalmanscan as ks
from kalmanscan.inputs import prepare
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter import triton

THETA_DT = np.array([3e-5, 0.3, 30.0])
OBS_VAR = np.array([1e-8, 1e-3, 1.0, 1e4, 1e8, 1e-5, 10.0, 1e6])
WALKS = config(stretch=16, closed_chunk=4, small_c_block=8, bwd_closed=True)
COTANGENTS = {"all four": (True, True, True, True), "mean": (True, False, False, False),
              "log-likelihood": (False, False, True, True)}


def extreme(dtype, T, init_var, gaps=(), seed=3):
    """``(views, init)`` of the extreme matrix (``theta dt`` along the batch, ``obs_var`` along the
    channels) with ``y`` missing at the ``(t, c)`` of ``gaps``."""
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(len(THETA_DT), T, len(OBS_VAR))) * np.sqrt(OBS_VAR) + 0.3
    for t, c in gaps:
        y[:, t, c] = np.nan
    kw = dict(theta=(THETA_DT / 0.7)[:, None, None], sigma=2.0, obs_var=OBS_VAR, dt=0.7, mean=0.3, h=1.5,
              init_var=init_var)
    p = prepare(torch.tensor(y, dtype=dtype, device=KERNEL_DEVICE), **array_tensors(kw, dtype))
    return triton.kernel_views(p), triton.initial_state(p)


def backward_both(views, init, present, cfg=WALKS, seed=0, stretch=None):
    """``(done, closed, read)``: the forward's ``done`` and the backward's four results with the
    closed-form precision and with ``lam`` read throughout, for random cotangents of the outputs
    ``present`` flags. With ``stretch`` (its length; programs of one stretch each) the closed
    backward gets a ``lam`` whose closed steps are NaN (but a stretch's last, the precision
    entering the next): it must not read them."""
    out = triton.filter_forward(views, init, config=cfg, closed_steps=True)
    g = torch.Generator(device="cpu").manual_seed(seed)
    cot = [torch.randn(out["mu"].shape, generator=g, dtype=out["mu"].dtype).to(KERNEL_DEVICE) if on else None
           for on in present]
    lam = out["lam"]
    if stretch is not None:
        lam = lam.clone()
        for b, row in enumerate(out["done"].tolist()):
            for s, done in enumerate(row):
                lam[b, s * stretch:s * stretch + min(done, stretch - 1)] = float("nan")
    closed = triton.filter_backward(views, init, out["mu"], lam, cot, cfg, out["done"])
    read = triton.filter_backward(views, init, out["mu"], out["lam"], cot, cfg)
    return out["done"], closed, read


@pytest.mark.parametrize("cotangents,init_var", [("all four", 1e-6), ("log-likelihood", 1e6), ("mean", 1.0)])
def test_float64_equals_reading_the_precision(cotangents, init_var, poisoned):
    """``T = 67`` in stretches of 16, chunks of 4, a gap at step 9 of stretch 1 (closed up to its
    chunk) and at the first step of stretch 3 (not closed), a partial last stretch: every gradient
    within ``1e-12`` of the backward that reads ``lam`` (given a ``lam`` that is NaN where the
    closed form applies), the initial precision far below, far above and between."""
    views, init = extreme(torch.float64, 67, init_var, gaps=((16 + 9, 3), (48, 0)))
    done, closed, read = backward_both(views, init, COTANGENTS[cotangents], stretch=16)
    assert done.tolist() == [[0, 8, 16, 0, 0]] * len(THETA_DT)
    for name, a, b in zip(("grad_y", "obs_grad", "trans_grad", "grad_init"), closed, read):
        assert max_rel_error(a, b) < 1e-12, name


def test_float32_within_the_float32_bound_of_float64():
    """Float32 gradients with the closed-form precision within :data:`FLOAT32_BOUND` (relative to
    each one's largest magnitude) of the float64 backward reading ``lam``: the closed form's few
    ulps do not show beside the walk's own rounding."""
    got, want = [], []
    for dtype, out in ((torch.float32, got), (torch.float64, want)):
        views, init = extreme(dtype, 48, 1e6)
        fwd = triton.filter_forward(views, init, config=WALKS, closed_steps=True)
        g = torch.Generator().manual_seed(0)
        cot = [torch.randn(fwd["mu"].shape, generator=g, dtype=torch.float64).to(dtype).to(KERNEL_DEVICE)
               for _ in range(4)]
        done = fwd["done"] if dtype == torch.float32 else None
        assert dtype == torch.float64 or int(done.max()) == 16
        out.extend(triton.filter_backward(views, init, fwd["mu"], fwd["lam"], cot, WALKS, done))
    for name, a, b in zip(("grad_y", "obs_grad", "trans_grad", "grad_init"), got, want):
        assert max_rel_error(a, b) < FLOAT32_BOUND, name


def test_off_by_default_and_with_per_step_parameters():
    """The default config records nothing (``done`` empty: the backward reads ``lam``); neither
    does a problem whose parameters vary along time."""
    views, init = extreme(torch.float64, 33, 1.0)
    assert triton.filter_forward(views, init, config=config(stretch=16, small_c_block=8),
                                 closed_steps=True)["done"].numel() == 0
    views["theta"] = views["theta"].contiguous()  # per step: a time stride
    assert triton.filter_forward(views, init, config=WALKS, closed_steps=True)["done"].numel() == 0


def test_done_of_another_launch_is_refused():
    views, init = extreme(torch.float64, 40, 1.0)
    out = triton.filter_forward(views, init, config=WALKS, closed_steps=True)
    with pytest.raises(ValueError, match="done"):
        triton.filter_backward(views, init, out["mu"], out["lam"], (out["mu"], None, None, None),
                               config(stretch=8, small_c_block=8, bwd_closed=True), out["done"])


def test_through_ks_filter_equals_torch_autograd(poisoned):
    """The public differentiable call at a launch where whole programs take the closed form
    (128 channels in stretches of 16): gradients of ``y`` and every parameter equal the float64
    torch backend's to ``1e-10``."""
    rng = np.random.default_rng(11)
    y, kw = random_problem(rng, 70, C=128, batch=(), missing=0.0)
    y[rng.random(y.shape) < 0.002] = np.nan
    cfg = config(stretch=16, closed_chunk=4, bwd_closed=True)
    grads = {}
    for backend in ("torch", "triton"):
        p, y_t, t = prepared(y, kw, grad=True)
        out = triton.filter(p, cfg) if backend == "triton" else torch_backend.filter(p)
        loss = (out["mean"].sin().sum() + out["var"].log().sum() + out["logliks"].sum())
        grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in NAMES])
    for a, b in zip(grads["torch"], grads["triton"]):
        assert float((a - b).norm() / a.norm()) < 1e-10


@pytest.mark.gpu
def test_compiled_closed_backward_on_cuda():
    """The compiled kernels at the default launch (4096 steps, 256 channels), float32: the closed
    precision's gradients within float32 rounding of the backward reading ``lam``."""
    rng = np.random.default_rng(8)
    y = torch.tensor(rng.normal(size=(4096, 256)) + 0.5, dtype=torch.float32, device="cuda")
    y[torch.rand(y.shape, device="cuda") < 1e-4] = float("nan")
    kw = dict(theta=rng.uniform(0.01, 1.0, 256), sigma=rng.uniform(0.1, 2.0, 256), obs_var=rng.uniform(0.01, 10.0, 256))
    p = ks.inputs.prepare(y, **array_tensors(kw, torch.float32, "cuda"))
    views, init = triton.kernel_views(p), triton.initial_state(p)
    done, closed, read = backward_both(views, init, COTANGENTS["all four"], cfg=config(bwd_closed=True))
    assert int(done.max()) > 0
    for name, a, b in zip(("grad_y", "obs_grad", "trans_grad", "grad_init"), closed, read):
        assert max_rel_error(a, b) < 1e-5, name
