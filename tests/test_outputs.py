"""``ks.filter(..., outputs=...)``: only the named fields are computed (the kernels write only
those on the triton backend), they equal the full call's, and the others are ``None``."""

import math

import numpy as np
import pytest
import torch
from helpers import device_of

import kalmanscan as ks
from kalmanscan.inference.filtering import OUTPUTS

BACKENDS = [b for b in ks.ops.filter.backend_names() if b != "auto"]
KW = dict(theta=0.3, sigma=0.7, obs_var=0.5)
FIELDS = [f for f in OUTPUTS if f != "missing"]
SELECTIONS = [("mean", "var"), ("loglik",), ("pred_obs_mean", "pred_obs_var", "missing"),
              ("precision", "pred_mean", "pred_var", "pred_precision", "logliks")]


def series(T=70, backend="cpu"):
    """A ``(2, T, 3)`` float64 series with a gap, on the backend's test device (:func:`helpers.device_of`)."""
    y = np.random.default_rng(0).normal(size=(2, T, 3))
    y[0, 5:9, 1] = np.nan
    return torch.tensor(y, device=device_of(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("outputs", SELECTIONS)
def test_selected_fields_equal_the_full_call(backend, outputs, poisoned):
    full = ks.filter(series(), backend="reference", **KW)
    post = ks.filter(series(backend=backend), backend=backend, outputs=outputs, **KW)
    wanted = set(outputs) | ({"logliks"} if "loglik" in outputs else set())
    for k in FIELDS:
        got = getattr(post, k)
        if k not in wanted:
            assert got is None, k
            continue
        np.testing.assert_allclose(got.cpu().numpy(), np.asarray(getattr(full, k)), rtol=1e-10, atol=1e-12, err_msg=k)
    assert (post.params["missing"] is None) == ("missing" not in outputs)
    assert "not computed" in repr(post)


@pytest.mark.parametrize("outputs", [("mean",), ("var",), None])
def test_inf_in_y_is_still_refused(outputs):
    y = series(backend="triton")
    y[1, 3, 0] = math.inf
    with pytest.raises(ValueError, match="y must be finite or NaN"):
        ks.filter(y, backend="triton", outputs=outputs, **KW)


@pytest.mark.parametrize("bad", ["mean", ("mean", "sd"), (), [1]])
def test_unknown_outputs_are_named(bad):
    with pytest.raises(ValueError, match="outputs"):
        ks.filter(series(), outputs=bad, **KW)


def test_diffuse_prior_with_selected_outputs():
    y = series(backend="triton")
    y[:, :2, :] = np.nan
    kw = dict(KW, init_var=math.inf)
    full = ks.filter(y, backend="torch", **kw)
    post = ks.filter(y, backend="triton", outputs=("mean", "loglik"), **kw)
    torch.testing.assert_close(post.mean, full.mean, equal_nan=True)
    torch.testing.assert_close(post.loglik, full.loglik)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
@pytest.mark.parametrize("diffuse", [False, True], ids=["stationary", "diffuse"])
def test_gradients_of_selected_fields_equal_the_full_call(backend, diffuse):
    """With gradients the torch and triton backends form only the selected fields from the
    filter's moments (:func:`kalmanscan.ops.filter.torch.finish`): the log-likelihood's gradient
    equals the full call's, diffuse prior included (a shorter series under the interpreter)."""
    y = series(17 if backend == "triton" else 70, backend)
    kw = dict(KW, init_var=math.inf) if diffuse else KW
    def grad(outputs, fields):
        theta = torch.tensor([0.3, 0.5, 0.2], dtype=torch.float64, requires_grad=True)
        post = ks.filter(y, backend=backend, outputs=outputs, **dict(kw, theta=theta))
        return torch.autograd.grad(sum(getattr(post, k).sum() for k in fields), theta)[0]

    other = ("mean", "pred_obs_var")
    grads = [grad(None, ("loglik",)), grad(None, other), grad(("loglik",), ("loglik",)), grad(other, other)]
    full_ll, full_other, sel_ll, sel_other = grads
    torch.testing.assert_close(sel_ll, full_ll, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sel_other, full_other, rtol=1e-12, atol=1e-12)
