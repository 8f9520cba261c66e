"""A default ``ks.filter`` call has its backend write the filtered moments and the log-likelihood;
the other Posterior fields are derived on first access (kalmanscan.inference.derived). Each is
compared with the reference backend's, which computes every field in its own loop."""

import copy
import zlib

import numpy as np
import pytest
import torch

import kalmanscan as ks
from kalmanscan.problem.problem import OUTPUTS
from helpers import KERNEL_DEVICE, array_tensors

DERIVED = ("precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean", "pred_obs_var", "logliks")
FIELDS = ("mean", "var", *DERIVED, "loglik")


def _case(name, rng, T=63, C=4):
    y = rng.normal(size=(2, T, C)) + 3.0
    y[0, 5:9, 1] = np.nan
    y[1, 0:3, 2] = np.nan
    y[:, T // 2, 3] = np.nan
    kw = dict(theta=np.abs(rng.normal(size=C)) + 0.1, sigma=rng.uniform(0.5, 1.5, size=C), obs_var=0.4, mean=2.5)
    if name == "diffuse":
        kw["init_var"] = np.array([np.inf, 1.0, np.inf, 2.0])
    if name == "per_step":
        kw.update(dt=rng.uniform(0.5, 1.5, size=(T, C)), obs_var=rng.uniform(0.2, 0.6, size=(T, C)),
                  h=rng.uniform(0.5, 1.5, size=(T, C)), mean=rng.normal(size=(T, C)))
    if name == "diffuse_per_step":
        kw.update(init_var=np.array([np.inf, 1.0, np.inf, 2.0]), theta=rng.uniform(0.1, 1.0, size=(T, C)))
    return y, kw


def _assert_fields(got, want, rtol, atol):
    for k in FIELDS:
        a, b = np.asarray(getattr(got, k), np.float64), np.asarray(getattr(want, k), np.float64)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=k)
    np.testing.assert_array_equal(np.asarray(got.params["missing"]), np.asarray(want.params["missing"]))
    np.testing.assert_array_equal(np.asarray(got.n_diffuse), np.asarray(want.n_diffuse))


@pytest.mark.parametrize("case", ["static", "diffuse", "per_step", "diffuse_per_step"])
@pytest.mark.parametrize("backend", ["cpu", "torch", "reference"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_derived_fields_match_reference(case, backend, kind):
    rng = np.random.default_rng(zlib.crc32(f"{case}-{backend}-{kind}".encode()))  # the same in every process
    y, kw = _case(case, rng)
    want = ks.filter(y, **kw, backend="reference", outputs=OUTPUTS)
    yin = y if kind == "numpy" else torch.as_tensor(y)
    got = ks.filter(yin, **kw, backend=backend)
    assert "_deferred" in got.__dict__  # nothing derived before it is read
    for k in DERIVED:
        assert isinstance(getattr(got, k), np.ndarray if kind == "numpy" else torch.Tensor)
    _assert_fields(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["static", "diffuse", "per_step", "diffuse_per_step"])
@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_decay_and_noise_read_from_the_problem(case, backend):
    """The cpu and triton backends leave decay and noise out of a default call (with parameters per step they
    are arrays of y's shape); the Posterior's are the problem's, made when read: those of the
    reference backend, which computes every field."""
    y, kw = _case(case, np.random.default_rng(29))
    want = ks.filter(y, **kw, backend="reference", outputs=OUTPUTS)
    if backend == "triton":  # on the GPU when there is one, as a user's call there
        got = ks.filter(torch.tensor(y, device=KERNEL_DEVICE), **array_tensors(kw), backend=backend)
    else:
        got = ks.filter(y, **kw, backend=backend)
    for k in ("decay", "noise"):
        have = got.params[k].cpu().numpy() if torch.is_tensor(got.params[k]) else got.params[k]
        np.testing.assert_allclose(np.broadcast_to(have, y.shape), np.broadcast_to(want.params[k], y.shape),
                                   rtol=1e-12, atol=0, err_msg=k)


@pytest.mark.parametrize("case", ["static", "diffuse", "per_step"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_float32_as_every_output(case, backend):
    rng = np.random.default_rng(7)
    y, kw = _case(case, rng)
    y32 = y.astype(np.float32)
    want = ks.filter(y32, **kw, backend=backend, outputs=OUTPUTS)
    got = ks.filter(y32, **kw, backend=backend)
    assert got.pred_var.dtype == np.float32 and got.logliks.dtype == np.float32
    _assert_fields(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got.loglik, want.loglik)  # the backend's sum, not re-derived


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_continued_stream(backend):
    rng = np.random.default_rng(3)
    y, kw = _case("static", rng, T=40)
    whole = ks.filter(y, **kw, backend="reference", outputs=OUTPUTS)
    first = ks.filter(y[:, :17], **kw, backend=backend)
    second = ks.filter(y[:, 17:], **kw, backend=backend, state=first.state)
    for k in DERIVED:
        np.testing.assert_allclose(getattr(second, k), getattr(whole, k)[:, 17:], rtol=1e-9, atol=1e-12, err_msg=k)


def test_outputs_still_limit():
    y, kw = _case("static", np.random.default_rng(1))
    post = ks.filter(y, **kw, outputs=("mean", "pred_var"))
    assert post.var is None and post.logliks is None and post.pred_var is not None
    assert "_deferred" not in post.__dict__


def test_cached_and_copied():
    y, kw = _case("diffuse", np.random.default_rng(2))
    post = ks.filter(y, **kw)
    text = repr(post)
    assert "_deferred" in post.__dict__ and "pred_var" in text and "not computed" not in text
    assert post.pred_var is post.pred_var
    again = copy.copy(ks.filter(y, **kw))
    assert "_deferred" not in again.__dict__
    np.testing.assert_array_equal(again.logliks, post.logliks)


def test_torch_device_dtype_and_graph():
    y, kw = _case("static", np.random.default_rng(4))
    yt = torch.tensor(y, requires_grad=True)
    post = ks.filter(yt, **kw)
    for k in DERIVED:
        x = getattr(post, k)
        assert x.dtype == torch.float64 and x.device == yt.device and x.requires_grad, k


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", ["static", "diffuse"])
def test_gradients_of_derived_fields(backend, case):
    rng = np.random.default_rng(5)
    y = torch.tensor(rng.normal(size=(1, 7, 2)))
    y[0, 3, 1] = float("nan")
    theta = torch.tensor([0.4, 1.1], dtype=torch.float64, requires_grad=True)
    sigma = torch.tensor([0.8, 1.2], dtype=torch.float64, requires_grad=True)
    obs_var = torch.tensor([0.3, 0.5], dtype=torch.float64, requires_grad=True)
    init_var = torch.tensor([np.inf, 1.5], dtype=torch.float64) if case == "diffuse" else None
    weights = {k: torch.tensor(rng.normal(size=(1, 7, 2))) for k in DERIVED}

    def f(theta, sigma, obs_var):
        post = ks.filter(y, theta=theta, sigma=sigma, obs_var=obs_var, init_var=init_var, backend=backend)
        terms = []
        for k in DERIVED:
            x = getattr(post, k)
            terms.append((torch.where(torch.isfinite(x), x, 0.0) * weights[k]).sum())
        return torch.stack(terms)

    assert torch.autograd.gradcheck(f, (theta, sigma, obs_var))


@pytest.mark.parametrize("case", ["static", "per_step"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_loops_sum_the_loglik_without_writing_the_terms(case, dtype):
    from kalmanscan.ops.filter.cpu import backend as cpu
    from kalmanscan.problem.prepare import prepare

    y, kw = _case(case, np.random.default_rng(8))
    p = prepare(y=y.astype(dtype), **kw)
    out = cpu.filter(p, outputs=("mean", "var", "loglik"))
    assert "logliks" not in out and out["loglik"].shape == (2, 4) and out["loglik"].dtype == p.dtype
    terms = cpu.filter(p, outputs=("logliks",))["logliks"].double().sum(-2)
    np.testing.assert_allclose(out["loglik"].double(), terms, rtol=1e-6 if dtype == np.float32 else 1e-13)


@pytest.mark.parametrize("case", ["static", "diffuse"])
def test_smoother_shares_the_filters_derived_fields(case):
    y, kw = _case(case, np.random.default_rng(9))
    post, filt = ks.smooth(y, **kw), ks.filter(y, **kw)
    for k in FIELDS:
        np.testing.assert_array_equal(getattr(post.filtered, k), getattr(filt, k), err_msg=k)
    for k in DERIVED[1:]:
        assert getattr(post, k) is getattr(post.filtered, k), k
    np.testing.assert_array_equal(post.params["missing"], filt.params["missing"])
