"""``ks.StreamFilter``: step by step equals one ``ks.filter`` call over the whole series, on every
backend, with missing values, batch dimensions, a diffuse start and float32; bad input is named."""

import warnings

import numpy as np
import pytest
import torch
from helpers import KERNEL_DEVICE, api_examples, to_np

import kalmanscan as ks


def problem(seed, T=41, batch=(), C=5):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=batch + (T, C)) + 3.0
    y[..., 7, 1] = np.nan
    y[..., 20:24, 3] = np.nan
    y[..., 10, 2] = np.nan  # in a one-step update
    kw = dict(theta=rng.uniform(0.05, 1.0, C), sigma=rng.uniform(0.2, 1.0, C), obs_var=0.6, mean=2.5,
              h=rng.uniform(0.5, 1.5, C), dt=0.7)
    return y, kw


def stream(f, y, cuts):
    """Feed ``y`` (..., T, C) to ``f`` in pieces: a single step (``update``) where a piece has
    length 1, else ``extend``; returns the concatenated outputs."""
    outs = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b - a == 1:
            outs.append({k: v[..., None, :] for k, v in f.update(y[..., a, :]).items()})
        else:
            outs.append(f.extend(y[..., a:b, :]))
    return {k: np.concatenate([to_np(o[k]) for o in outs], -2) for k in outs[0]}


FIELDS = ("mean", "var", "precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean", "pred_obs_var",
          "logliks")
CUTS = [0, 1, 2, 3, 10, 11, 30, 31, 41]


def streamed_and_whole(y, kw, backend):
    """``(f, got, whole)``: ``y`` streamed through a :class:`StreamFilter` in :data:`CUTS`, every
    field held to one ``ks.filter`` call over it."""
    if backend == "triton":  # NumPy runs on the CPU: through the interpreter, or on a GPU as a CUDA tensor
        y = torch.tensor(y, device=KERNEL_DEVICE)
    whole = ks.filter(y, backend=backend, **kw)
    f = ks.StreamFilter(**kw, backend=backend, outputs=FIELDS)
    got = stream(f, y, CUTS)
    for k in FIELDS:
        np.testing.assert_allclose(got[k], to_np(getattr(whole, k)), rtol=1e-12, atol=1e-12, err_msg=k)
    return f, got, whole


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton", "reference"])
def test_stream_equals_one_call(backend):
    f, _, whole = streamed_and_whole(*problem(0, batch=(2,)), backend)
    np.testing.assert_allclose(to_np(f.loglik), to_np(whole.loglik), rtol=1e-12)
    assert f.state.steps == 41
    np.testing.assert_allclose(to_np(f.state.mean), to_np(whole.mean[..., -1, :]), rtol=1e-12)
    assert (f._rows is not None) == (backend in ("triton", "cpu"))  # one-step updates ran the stream step
    assert (f._rows_np is not None) == (backend == "cpu")  # in NumPy on the cpu backend


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton", "reference"])
def test_batch_from_the_parameters(backend):
    """``y`` of shape ``(T, C)`` with ``sigma`` ``(B, 1, C)`` and ``init_mean`` ``(B, C)``: the
    stream's batch comes from the parameters, as in ``ks.filter``; each update takes ``y``'s shape."""
    y, kw = problem(6)
    rng = np.random.default_rng(6)
    kw = dict(kw, sigma=rng.uniform(0.2, 1.0, (3, 1, 5)), init_mean=rng.normal(size=(3, 5)))
    f, got, _ = streamed_and_whole(y, kw, backend)
    assert got["mean"].shape == (3, 41, 5) and f.state.mean.shape == (3, 5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_step_over_several_blocks(dtype):
    """The cpu step over 150 series (not a multiple of any vector width), gaps anywhere."""
    rng = np.random.default_rng(7)
    y = (rng.normal(size=(12, 150)) + 1.0).astype(dtype)
    y[rng.random(y.shape) < 0.2] = np.nan
    kw = dict(theta=rng.uniform(0.05, 2.0, 150), sigma=rng.uniform(0.0, 1.0, 150), obs_var=rng.uniform(0.1, 2, 150),
              mean=rng.normal(size=150), h=rng.uniform(0.5, 1.5, 150), init_var=1.0)
    whole = ks.filter(y, backend="cpu", **kw)
    f = ks.StreamFilter(**kw, backend="cpu", outputs=FIELDS)
    got = stream(f, y, list(range(13)))
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for k in FIELDS:
        np.testing.assert_allclose(got[k], getattr(whole, k), rtol=tol, atol=tol, err_msg=k)
    g = ks.StreamFilter(**kw, backend="cpu")
    g.update(y[0])
    first, state, loglik = g.update(y[1]), g.state, g.loglik
    kept = [x.copy() for x in (first["mean"], first["var"], state.mean, state.var, loglik)]
    assert first["mean"].dtype == whole.mean.dtype == dtype  # the step's result in y's dtype
    g.update(y[2])
    for was, now in zip(kept, (first["mean"], first["var"], state.mean, state.var, loglik)):
        np.testing.assert_array_equal(was, now)  # a later update writes nothing already returned


def test_numpy_stream_takes_any_float_y_and_leaves_it_unmodified():
    """A float32 NumPy stream on the cpu backend fed a float64 step, a strided view and a
    broadcast row gives the float32 step's result, and writes none of them."""
    rng = np.random.default_rng(8)
    y = (rng.normal(size=(6, 2, 7)) + 1.0).astype(np.float32)
    y[2, 1, 3] = np.nan
    kw = dict(theta=rng.uniform(0.1, 1.0, 7), sigma=0.5, obs_var=0.7, mean=0.3)
    want = ks.StreamFilter(**kw, backend="cpu")
    want.update(y[0])
    got = ks.StreamFilter(**kw, backend="cpu")
    got.update(y[0])
    wide = np.zeros((6, 2, 14), np.float64)
    wide[..., ::2] = y
    for t, step in ((1, y[1].astype(np.float64)), (2, wide[2, :, ::2]), (3, np.broadcast_to(y[3, :1], (2, 7)))):
        if t == 3:
            y[3, 1] = y[3, 0]
        kept = np.array(step, copy=True)
        a, b = want.update(y[t]), got.update(step)
        np.testing.assert_array_equal(step, kept)
        for k in a:
            assert b[k].dtype == np.float32
            np.testing.assert_array_equal(b[k], a[k])
    np.testing.assert_array_equal(got.state.mean, want.state.mean)
    np.testing.assert_array_equal(got.loglik, want.loglik)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_gradients_flow_through_every_update(backend):
    """Parameters, an initial mean and a ``y`` that need gradients: the updates' log-likelihood and
    last mean have the gradients of one ``ks.filter`` call over the steps (the stored one-step
    kernels, which are not differentiable, are not used while a gradient is tracked)."""
    rng = np.random.default_rng(9)
    y = torch.tensor(rng.normal(size=(6, 3)) + 1.0, device=KERNEL_DEVICE)
    y[3, 1] = float("nan")

    def leaves():
        return [torch.tensor(v, device=KERNEL_DEVICE, requires_grad=True)
                for v in (rng.uniform(0.2, 1.0, 3), 0.7, rng.normal(size=3))]

    def grads(out, xs):
        return torch.autograd.grad(out["loglik"].sum() + out["mean"].sum(), xs)

    theta, sigma, init_mean = xs = leaves()
    y_leaf = y.clone().requires_grad_()
    whole = ks.filter(y_leaf, theta=theta, sigma=sigma, obs_var=0.5, init_mean=init_mean, init_var=2.0, backend=backend)
    want = grads(dict(loglik=whole.loglik, mean=whole.mean[-1]), xs + [y_leaf])
    f = ks.StreamFilter(theta=theta, sigma=sigma, obs_var=0.5, init_mean=init_mean, init_var=2.0, backend=backend)
    steps = [y_leaf[t] for t in range(6)]
    last = [f.update(step) for step in steps][-1]
    got = grads(dict(loglik=f.loglik, mean=last["mean"]), xs + [y_leaf])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, equal_nan=True)
    with torch.no_grad():                      # without gradients the stored step runs again
        g = ks.StreamFilter(theta=theta, sigma=sigma, obs_var=0.5, backend=backend)
        g.update(y[0])
        g.update(y[1])
        assert (g._rows is not None) == (backend in ("cpu", "triton"))


def test_stream_kernel_catches_inf_and_leaves_the_state():
    y, kw = problem(5)
    y = torch.tensor(y, device=KERNEL_DEVICE)
    bad = y[3].clone()
    bad[1] = np.inf
    for check in (True, False):
        f = ks.StreamFilter(**kw, backend="triton", check_finite=check)
        f.extend(y[:3])
        f.update(y[2])
        before = to_np(f.state.var).copy()
        if check:
            with pytest.raises(ValueError, match="y must be finite"):
                f.update(bad)
            assert f.state.steps == 4
            np.testing.assert_array_equal(to_np(f.state.var), before)
        else:
            assert not np.isfinite(to_np(f.update(bad)["mean"])[1])


def test_float32_torch_and_a_diffuse_start():
    """Torch float32 in, torch out; ``init_var = inf`` with channel 3 unobserved for a while: the
    updates take the public path until every channel is observed, then the stored one."""
    y, kw = problem(1, T=30)
    y[:12, 3] = np.nan
    kw = dict(kw, theta=0.0, init_var=float("inf"))
    y32 = torch.tensor(y, dtype=torch.float32)
    whole = ks.filter(y32, **kw)
    f = ks.StreamFilter(**kw, outputs=("mean", "var", "logliks"))
    got = [f.update(y32[t]) for t in range(30)]
    assert isinstance(got[0]["mean"], torch.Tensor) and got[0]["mean"].dtype == torch.float32
    mean = torch.stack([g["mean"] for g in got])
    torch.testing.assert_close(mean, whole.mean, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(f.loglik, whole.loglik, rtol=2e-6, atol=1e-4)
    assert not f._diffuse


def test_state_continues_in_ks_filter():
    y, kw = problem(2)
    f = ks.StreamFilter(**kw)
    f.extend(y[:25])
    rest = ks.filter(y[25:], **kw, state=f.state)
    np.testing.assert_allclose(rest.mean, ks.filter(y, **kw).mean[25:], rtol=1e-12)


def test_inf_is_caught_unless_check_finite_is_off():
    y, kw = problem(3)
    f = ks.StreamFilter(**kw)
    f.extend(y[:5])
    bad = y[5].copy()
    bad[2] = np.inf
    bad.flags.writeable = False  # a read-only step is searched without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="y must be finite"):
            f.update(bad)
    assert f.state.steps == 5  # the failed update left the state as it was
    g = ks.StreamFilter(**kw, check_finite=False)
    g.extend(y[:5])
    assert not np.isfinite(g.update(bad)["mean"][2])


def test_bad_input_is_named():
    y, kw = problem(4)
    with pytest.raises(ValueError, match="theta must be static"):
        ks.StreamFilter(**dict(kw, theta=np.full((41, 5), 0.3)))
    with pytest.raises(ValueError, match="outputs must be"):
        ks.StreamFilter(**kw, outputs=("mean", "bogus"))
    with pytest.raises(ValueError, match="sigma must be"):
        ks.StreamFilter(**dict(kw, sigma=-1.0)).update(y[0])
    f = ks.StreamFilter(**kw)
    f.update(y[0])
    with pytest.raises(ValueError, match=r"y must have shape \(5,\)"):
        f.update(y[1, :4])
    with pytest.raises(ValueError, match="y must have shape"):
        f.extend(y[1])
    with pytest.raises(ValueError, match="y must be a NumPy array"):
        f.update(torch.tensor(y[1]))
    with pytest.raises(ValueError, match="y must hold at least one step"):
        f.extend(y[1:1])
    assert f.state.steps == 1
    with pytest.raises(ValueError, match="y must hold at least one step"):
        ks.StreamFilter(**kw).extend(y[:0])
    before = y.copy()
    f.extend(y[1:])
    np.testing.assert_array_equal(y, before)  # nothing the caller passed is modified


def test_the_docs_example_runs():
    for block in api_examples("ks.StreamFilter("):
        exec(compile(block, "docs/api.md", "exec"), {})
