"""The single-pass forward (``FilterConfig.onepass``; kernels under TRITON_INTERPRET=1) against the
float64 reference, the three-kernel walks and torch autograd.

Stretches are a few steps long so that short series cross many of them; ``onepass_publish`` above
1 makes most stretches publish only their map, so the look-back composes maps (under the
interpreter programs run one after another, and every earlier stretch would otherwise have
published the state after it). Blocks of 4 channels make several channel blocks per batch row.
"""

import numpy as np
import pytest
import torch
from helpers import (FLOAT32_BOUND, KERNEL_DEVICE, NAMES, Launches, config, posterior_error, prepared,
                     random_problem, triton_filter)

import kalmanscan as ks
from kalmanscan.filtering import make_posterior, sum_time
from kalmanscan.ops.filter import onepass, triton


def one(**options):
    """Single-pass stretches of 4 steps in blocks of 4 channels, then ``options``."""
    return config(**{"onepass": 4, "onepass_block": 4, **options})


# (T, config, batch, C, per_step, times, missing, dtype): 63 steps (16 stretches, the last of 3) over
# two channel blocks; 301 steps on stretches of 8 with three of four states unpublished, flags read
# four at a time; per-step parameters and irregular times, flags two at a time; 61 steps on
# stretches of 5 with 64-bit offsets; T = 5 (two stretches, the last of one step). Both dtypes on
# the first case, one on each other.
CASES = [
    (63, one(), (2,), 5, False, False, 0.15, torch.float64),
    (63, one(), (2,), 5, False, False, 0.15, torch.float32),
    (301, one(onepass=8, onepass_publish=4, onepass_lookback=4), (), 3, False, False, 0.1, torch.float32),
    (63, one(onepass_publish=3, onepass_lookback=2), (2,), 3, True, True, 0.15, torch.float64),
    (61, one(onepass=5, wide_from=0, onepass_publish=2), (2,), 4, True, False, 0.1, torch.float32),
    (5, one(), (), 2, False, False, 0.0, torch.float64),
]
IDS = ["T63-2blocks-f64", "T63-2blocks-f32", "T301-publish4-f32", "T63-steps-times-f64", "T61-wide-f32", "T5-f64"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_onepass_equals_reference(case, poisoned, monkeypatch):
    """Every posterior field, one launch and no walk: float64 to 1e-10, float32 within
    :data:`FLOAT32_BOUND`; the log-likelihood summed in the kernel equals the per-step sum."""
    T, cfg, batch, C, per_step, times, missing, dtype = case
    rng = np.random.default_rng(T + C)
    y, kw = random_problem(rng, T, C=C, batch=batch, per_step=per_step, times=times, missing=missing,
                           offset=100.0 if dtype == torch.float32 else 0.0)
    launches, walks = Launches(onepass.filter_onepass_kernel), Launches(triton.filter_fwd_kernel)
    monkeypatch.setattr(onepass, "filter_onepass_kernel", launches)
    monkeypatch.setattr(triton, "filter_fwd_kernel", walks)
    p = prepared(y, kw, dtype)[0]
    out = triton.filter(p, cfg)
    assert (launches.count, walks.count) == (1, 0)
    err, errs = posterior_error(make_posterior(p, dict(out)), ks.filter(y, backend="reference", **kw))
    assert err < (1e-10 if dtype == torch.float64 else FLOAT32_BOUND), errs
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out["loglik"], sum_time(out["logliks"]), rtol=tol, atol=tol)


def test_onepass_equals_the_walks_centred_outputs(poisoned):
    """The centred outputs the autograd path asks for, one alone and all four, equal the
    three-kernel walks' to float64 rounding."""
    rng = np.random.default_rng(7)
    y, kw = random_problem(rng, 21, C=6, batch=(2,), missing=0.1)
    views = triton.kernel_views(prepared(y, kw)[0])
    p = prepared(y, kw)[0]
    init = triton.initial_state(p)
    for outputs in (("lam",), ("mu", "lam", "pred_mu", "pred_var")):
        fast = triton.filter_forward(views, init, outputs=outputs, config=one(onepass_publish=2))
        walks = triton.filter_forward(views, init, outputs=outputs, config=config(min_stretch=4, target_lanes=1 << 30))
        assert set(fast) == set(outputs)
        for k in outputs:
            torch.testing.assert_close(fast[k], walks[k], rtol=1e-12, atol=1e-12)


def test_onepass_gradients_equal_torch_autograd(poisoned):
    """Through the autograd path (the single-pass forward, then the backward walks that read its
    filtered mean and precision), gradients of ``y`` and every parameter equal the torch
    backend's to 1e-10."""
    rng = np.random.default_rng(11)
    T, batch = 29, (2,)
    y, kw = random_problem(rng, T, C=3, batch=batch, missing=0.15)
    weights = [torch.tensor(rng.normal(size=batch + (T, 3)), device=KERNEL_DEVICE) for _ in range(2)]
    grads = {}
    for backend in ("torch", "triton"):
        p, y_t, t = prepared(y, kw, grad=True)
        post = triton_filter(p, one(onepass_publish=2)) if backend == "triton" else ks.filter(y_t, backend="torch", **t)
        loss = sum((getattr(post, k) * w).sum() for k, w in zip(("mean", "var"), weights)) + post.loglik.sum()
        grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in NAMES])
    for name, a, b in zip(("y",) + NAMES, grads["torch"], grads["triton"]):
        assert float((a - b).norm() / a.norm()) < 1e-10, name


def test_onepass_serves_the_walks_only():
    """One stretch or fewer steps, and the time-parallel tiles, keep their kernels; 0 turns it off."""
    assert onepass.applies(9, one()) and not onepass.applies(4, one()) and not onepass.applies(9, config())
    with pytest.raises(ValueError, match="onepass"):
        config(onepass=-1)
    with pytest.raises(ValueError, match="onepass_block"):
        config(onepass_block=0)
    with pytest.raises(ValueError, match="onepass_lookback"):
        config(onepass_lookback=3)
