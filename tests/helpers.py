"""Shared test utilities: random filter problems, random KLA layers and relative-error comparisons."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import numpy as np
import torch

from benchmarks import common

# The device the torch backend is tested on: set KALMANSCAN_TEST_DEVICE=cuda on a GPU machine.
DEVICE = torch.device(os.environ.get("KALMANSCAN_TEST_DEVICE", "cpu"))
# The device the Triton kernels' tests run on: CUDA where the kernels compile (a GPU machine with
# TRITON_INTERPRET unset or 0), else the CPU through the interpreter (as in CI).
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                             else "cpu")


def device_of(backend: str) -> torch.device:
    """Where a backend's test tensors are made: the triton backend's on :data:`KERNEL_DEVICE`,
    the others' on the CPU."""
    return KERNEL_DEVICE if backend == "triton" else torch.device("cpu")

POSITIVE = ("var", "precision", "pred_var", "pred_precision", "pred_obs_var")
SIGNED = ("mean", "pred_mean", "pred_obs_mean", "logliks", "loglik")
FIELDS = POSITIVE + SIGNED


def to_np(x):
    return x.detach().cpu().double().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=float)


def rel_error(actual, ref):
    """Elementwise relative error for positive fields; max-norm relative error for signed ones."""
    a, r = to_np(actual), to_np(ref)
    assert a.shape == r.shape, (a.shape, r.shape)
    assert np.all(np.isfinite(a)), "non-finite values in the result"
    return float(np.max(np.abs(a - r) / np.maximum(np.abs(r), 1e-300)))


def max_rel_error(actual, ref):
    a, r = to_np(actual), to_np(ref)
    assert a.shape == r.shape, (a.shape, r.shape)
    assert np.all(np.isfinite(a)), "non-finite values in the result"
    scale = max(np.max(np.abs(r)), 1e-300)
    return float(np.max(np.abs(a - r)) / scale)


def posterior_error(post, ref, fields=FIELDS):
    """Worst relative error over the posterior fields (see :func:`rel_error`)."""
    errs = {}
    for k in fields:
        fn = rel_error if k in POSITIVE else max_rel_error
        errs[k] = fn(getattr(post, k), getattr(ref, k))
    return max(errs.values()), errs


def random_problem(rng, T, C=3, batch=(2,), per_step=False, missing=0.1, times=False, offset=0.0):
    """A random, non-degenerate filter problem: ``(y, kwargs)`` with NumPy float64 arrays."""
    shape = batch + (T, C)
    pshape = shape if per_step else (C,)
    kw = dict(
        theta=rng.uniform(0.01, 2.0, pshape),
        sigma=rng.uniform(0.1, 2.0, pshape),
        obs_var=rng.uniform(0.05, 3.0, pshape),
        mean=offset + rng.normal(size=pshape),
        h=rng.uniform(0.5, 2.0, pshape) * rng.choice([-1, 1], pshape),
        init_mean=offset + rng.normal(size=batch + (C,)),
        init_var=rng.uniform(0.1, 5.0, batch + (C,)),
    )
    if times:
        kw["times"] = np.cumsum(rng.uniform(0.05, 3.0, T)) + rng.normal()
    else:
        kw["dt"] = rng.uniform(0.1, 2.0)
    y = offset + rng.normal(size=shape) * 2.0
    y[rng.random(shape) < missing] = np.nan
    return y, kw


def on_device(y, dtype=torch.float64):
    """``y`` as a tensor on the test device."""
    return torch.tensor(y, dtype=dtype, device=DEVICE)


# The differentiable parameters of ks.filter, in the order the gradient tests list them.
NAMES = ("theta", "sigma", "obs_var", "mean", "h", "init_mean", "init_var")
# Worst float32 error of the triton kernels (interpreter) over the random problems of the former
# test_triton_filter.py::test_float32_within_measured_bound was 3.8e-7 (relative, on
# pred_precision at T = 301; now the float32 cases of tests/ops/filter/test_triton.py); the
# bound keeps a factor of ~10 and is the torch backend's float32 bound (tests/test_filter.py).
FLOAT32_BOUND = 4e-6


def problem_tensors(kw, dtype=torch.float64, grad=False, device="cpu"):
    """The keywords ``kw`` of :func:`random_problem` as tensors of ``dtype`` on ``device`` (``times``
    stays float64); with ``grad`` the :data:`NAMES` require gradients."""
    out = {}
    for k, v in kw.items():
        t = torch.tensor(v, dtype=torch.float64 if k == "times" else dtype, device=device)
        out[k] = t.requires_grad_() if grad and k in NAMES else t
    return out


def array_tensors(kw, dtype=torch.float64, device=None):
    """The keywords ``kw`` with their NumPy arrays as tensors of ``dtype`` on ``device`` (default
    :data:`KERNEL_DEVICE`) and every other value as it is (a Python number stays a number)."""
    device = KERNEL_DEVICE if device is None else device
    return {k: torch.tensor(v, dtype=dtype, device=device) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


class Launches:
    """A kernel whose launches are counted (``kernel[grid](...)`` goes through)."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def config(**options):
    """The default :class:`~kalmanscan.ops.filter.triton.config.FilterConfig` with ``options`` replaced."""
    from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG

    return dataclasses.replace(DEFAULT_CONFIG, **options)


def prepared(y, kw, dtype=torch.float64, grad=False):
    """``(p, y_t, t)``: the validated problem of the NumPy problem ``(y, kw)`` as tensors of
    ``dtype`` on :data:`KERNEL_DEVICE` (``y_t`` and the :data:`NAMES` in ``t`` require gradients
    with ``grad``)."""
    from kalmanscan.problem.prepare import prepare

    t = problem_tensors(kw, dtype, grad=grad, device=KERNEL_DEVICE)
    y_t = torch.tensor(y, dtype=dtype, requires_grad=grad, device=KERNEL_DEVICE)
    return prepare(y_t, **t), y_t, t


def triton_filter(p, cfg):
    """:func:`kalmanscan.filter` of the validated problem ``p`` on the triton backend launched with
    the config ``cfg``: a :class:`~kalmanscan.Posterior`."""
    from kalmanscan.inference.filtering import make_posterior
    from kalmanscan.ops.filter.triton import backend as triton

    return make_posterior(p, triton.filter(p, cfg))


def triton_smooth(p, cfg):
    """:func:`kalmanscan.smooth` of ``p`` on the triton backend launched with ``cfg``."""
    from kalmanscan.inference.filtering import make_posterior
    from kalmanscan.ops.filter.triton import backend as triton

    out = triton.filter(p, cfg)
    full = {k: torch.broadcast_to(out[k], p.shape) for k in ("mean", "var", "pred_mean", "pred_var", "decay", "noise")}
    mean_s, var_s, precision_s = triton.smooth(full, torch.broadcast_to(p.mean, p.shape), cfg)
    return make_posterior(p, dict(out, mean=mean_s, var=var_s, precision=precision_s),
                          filtered=make_posterior(p, out))


def forward_views(y, kw):
    """``(views, init)`` that :func:`kalmanscan.ops.filter.triton.filter_forward` takes for the
    NumPy problem ``(y, kw)`` (float64)."""
    from kalmanscan.problem.prepare import prepare
    from kalmanscan.ops.filter.triton.backend import kernel_views

    p = prepare(torch.tensor(y), **problem_tensors(kw))
    views = kernel_views(p)
    B, C = views["y"].shape[0], p.shape[-1]
    per_series = p.shape[:-2] + (1, C)
    lam0 = 1.0 / torch.broadcast_to(p.init_var, per_series).reshape(B, C)
    mu0 = torch.broadcast_to(p.init_mean - p.mean[..., :1, :], per_series).reshape(B, C)
    return views, torch.stack([lam0, lam0 * mu0], 1)


def random_kla(variant="plain", discretization="ou", d_model=4, d_state=3, seed=0, init="kalmanscan", **kwargs):
    """A float64 ``KLA`` layer (scheme ``init``, by default the one with ``log_sigma`` and a
    per-channel skip) on the torch backend with every parameter moved off its initial value (so
    all paths are exercised); ``kwargs`` go to the constructor."""
    from kalmanscan.nn import KLA

    torch.manual_seed(seed)
    layer = KLA(d_model, d_state=d_state, expand=2, variant=variant, discretization=discretization,
                init=init, backend="torch", **kwargs).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def api_examples(marker: str) -> list[str]:
    """The ``python`` code blocks of docs/api.md that contain ``marker`` (at least one)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b]
    assert blocks, f"docs/api.md has no example containing {marker!r}"
    return blocks


def synchronisations(fn) -> int:
    """Device synchronisations made by ``fn()`` (:func:`benchmarks.common.synchronisations`: torch's
    sync debug mode's reports, the blocking copies from pageable host memory included, which no
    operation count shows, and the waits on events, a read of values queued before the kernels,
    ``checks.Ahead``)."""
    return common.synchronisations(fn)[1]
