"""Streaming (``state=``): a series filtered chunk by chunk equals one call over the whole series.

Chunks of lengths 1, 1, 28, 10 (all missing) and 23 on every backend, with ``dt`` (static and per
step) or ``times``, static or per-step parameters, float64 and float32, against one call of the
same backend and against the float64 reference; a diffuse prior whose channels stay unobserved
across a chunk boundary; the smoother of a chunk against the smoother of the series up to its end;
gradients through the state; the errors that name ``state``.
"""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import (FIELDS, FLOAT32_BOUND, api_examples, device_of, max_rel_error, posterior_error, random_problem,
                     to_np)

import kalmanscan as ks

CUTS = (0, 1, 2, 30, 40, 63)  # chunks of 1, 1, 28, 10 and 23 steps; y[..., 30:40, :] is all NaN
T = CUTS[-1]
LAYOUTS = [(False, False, False), (True, True, False), (True, False, True), (False, True, False)]
# The state enters every backend as the prior (init_mean, init_var), which the backends' own tests
# cover with every layout: the interpreted triton kernels run static parameters and dt only here.
CASES = [(b, *layout) for b in ("reference", "torch", "cpu") for layout in LAYOUTS] + [("triton", *LAYOUTS[0])]


def problem(seed, per_step=False, times=False, per_step_dt=False, offset=0.0):
    """A random problem over ``T`` steps whose chunk ``CUTS[3]:CUTS[4]`` is all missing."""
    rng = np.random.default_rng(seed)
    y, kw = random_problem(rng, T, per_step=per_step, times=times, missing=0.15, offset=offset)
    if per_step_dt:
        kw["dt"] = rng.uniform(0.1, 2.0, y.shape)
    y[..., CUTS[3]:CUTS[4], :] = np.nan
    return y, kw


def chunk(y, kw, a, b):
    """``y`` and ``kw`` at steps ``a:b`` (the prior only for the first chunk)."""
    out = {}
    for name, v in kw.items():
        if name in ("init_mean", "init_var"):
            if a == 0:
                out[name] = v
            continue
        if isinstance(v, torch.Tensor) and v.ndim < 2:  # a static parameter that carries a gradient
            out[name] = v
            continue
        v = np.asarray(v)
        if name == "times" and v.ndim == 1:
            out[name] = v[a:b]
        elif v.ndim >= 2 and v.shape[-2] == y.shape[-2]:
            out[name] = v[..., a:b, :]
        else:
            out[name] = v
    return y[..., a:b, :], out


def stream(fn, y, kw, cuts=CUTS, convert=lambda x: x, **opts):
    """``fn`` over the chunks of ``y`` between ``cuts``, each continuing the previous one's state."""
    state, parts = None, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        yc, kc = chunk(y, kw, a, b)
        post = fn(convert(yc), state=state, **kc, **opts)
        parts.append(post)
        state = post.state
    return parts


def joined(parts):
    """The chunks' posteriors as one (fields concatenated in time, log-likelihoods added)."""
    cat = (lambda xs: torch.cat(xs, -2)) if isinstance(parts[0].mean, torch.Tensor) else (
        lambda xs: np.concatenate(xs, -2))
    fields = {k: cat([getattr(q, k) for q in parts]) for k in FIELDS if k != "loglik"}
    return dataclasses.replace(parts[0], loglik=sum(q.loglik for q in parts), **fields)


@pytest.mark.parametrize("backend,per_step,times,per_step_dt", CASES)
def test_chunks_equal_one_call(backend, per_step, times, per_step_dt, poisoned):
    """Float64 chunks against one call of the same backend and the reference (data offset by 1e4,
    so the state's deviation from the level is exercised), to float64 rounding."""
    y, kw = problem(10 * per_step + 2 * times + per_step_dt, per_step, times, per_step_dt, offset=1e4)
    convert = (lambda x: x) if backend == "reference" else (lambda x: torch.tensor(x, device=device_of(backend)))
    parts = stream(ks.filter, y, kw, convert=convert, backend=backend)
    whole = ks.filter(convert(y), backend=backend, **kw)
    ref = ks.filter(y, backend="reference", **kw)
    for other in (whole, ref):
        err, errs = posterior_error(joined(parts), other)
        assert err < 1e-10, errs
    state = parts[-1].state
    assert state.steps == T and (state.time is not None) == times
    if times:
        assert np.array_equal(to_np(state.time)[..., 0], np.broadcast_to(kw["times"][-1], state.time.shape[:-1]))


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_float32_chunks(backend):
    """Float32 chunks within the float32 bound of the reference, as one float32 call is."""
    y, kw = problem(3, per_step=backend != "triton", times=backend != "triton", offset=100.0)
    parts = stream(ks.filter, y, kw, convert=lambda x: torch.tensor(x, dtype=torch.float32, device=device_of(backend)),
                   backend=backend)
    assert parts[-1].mean.dtype == torch.float32 and parts[-1].state.var.dtype == torch.float32
    err, errs = posterior_error(joined(parts), ks.filter(y, backend="reference", **kw))
    assert err < FLOAT32_BOUND, errs


def test_one_step_per_call():
    """A sensor stream updated one step per call (torch tensors, ``times``, the state carried)."""
    y, kw = problem(4, per_step=True, times=True)
    parts = stream(ks.filter, y, kw, cuts=tuple(range(T + 1)), convert=torch.tensor, backend="torch")
    err, errs = posterior_error(joined(parts), ks.filter(y, backend="reference", **kw))
    assert err < 1e-10, errs


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu"])
def test_diffuse_prior_across_chunks(backend):
    """``init_var = inf``: a channel unobserved through the first two chunks keeps ``var = inf`` in
    the state, and its first observation is left out of the log-likelihood in a later chunk, as in
    one call; a random-walk channel (``theta = 0``) needs no ``init_var`` after the first chunk."""
    rng = np.random.default_rng(7)
    y = rng.normal(size=(2, T, 3))
    y[0, :35, 1] = np.nan
    y[1, :, 1] = np.nan  # never observed
    kw = dict(theta=[0.0, 0.4, 1.1], sigma=[0.5, 1.0, 2.0], obs_var=0.6, mean=[0.0, 3.0, -2.0],
              init_var=np.array([np.inf, np.inf, 2.0]))
    convert = (lambda x: x) if backend == "reference" else torch.tensor
    parts = stream(ks.filter, y, kw, convert=convert, backend=backend)
    whole = ks.filter(convert(y), backend=backend, **kw)
    assert np.isinf(to_np(parts[1].state.var)[0, 1]) and np.isinf(to_np(parts[-1].state.var)[1, 1])
    j = joined(parts)
    for k in FIELDS:
        a, b = to_np(getattr(j, k)), to_np(getattr(whole, k))
        assert np.array_equal(np.isinf(a), np.isinf(b)), k
        finite = np.isfinite(b)
        assert np.max(np.abs(a[finite] - b[finite]) / np.maximum(np.abs(b[finite]), 1.0)) < 1e-12, k
    assert np.array_equal(sum(to_np(q.n_diffuse) for q in parts), to_np(whole.n_diffuse))
    if backend == "torch":  # gradients through a state whose variance is inf stay finite and exact
        theta = torch.tensor(kw["theta"], dtype=torch.float64, requires_grad=True)
        parts = stream(ks.filter, y, dict(kw, theta=theta), convert=torch.tensor, backend=backend)
        got, = torch.autograd.grad(sum(q.loglik.sum() for q in parts), theta)
        want, = torch.autograd.grad(ks.filter(torch.tensor(y), backend=backend, **dict(kw, theta=theta)).loglik.sum(),
                                    theta)
        assert torch.isfinite(got).all() and max_rel_error(got, want) < 1e-10


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu", "triton"])
def test_smoother_of_a_chunk_is_conditioned_on_the_past(backend):
    """``ks.smooth(chunk, state=...)`` is the smoother of the series up to the chunk's end, on the
    chunk's steps; its last step is the filter's."""
    y, kw = problem(5, per_step=backend != "triton", times=backend != "triton")
    a, b = 20, 45
    convert = (lambda x: x) if backend == "reference" else (lambda x: torch.tensor(x, device=device_of(backend)))
    past = ks.filter(convert(chunk(y, kw, 0, a)[0]), backend=backend, **chunk(y, kw, 0, a)[1])
    yc, kc = chunk(y, kw, a, b)
    got = ks.smooth(convert(yc), state=past, backend=backend, **kc)
    y_upto, kw_upto = chunk(y, kw, 0, b)
    ref = ks.smooth(y_upto, backend="reference", **kw_upto)
    for k in ("mean", "var", "precision"):
        assert max_rel_error(getattr(got, k), getattr(ref, k)[..., a:, :]) < 1e-10, k
    assert np.array_equal(to_np(got.mean[..., -1, :]), to_np(got.filtered.mean[..., -1, :]))
    assert got.state.steps == b


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gradients_through_the_state(backend):
    """The chunks' log-likelihood has the gradient of one call's, with respect to ``y``, the
    parameters and the prior (through the state); gradcheck on the state's fields."""
    y, kw = problem(6, per_step=False, times=True)
    y, kw = y[:, :12], dict(kw, times=kw["times"][:12])
    leaves = {k: torch.tensor(kw[k], requires_grad=True) for k in ("theta", "sigma", "obs_var", "mean", "h",
                                                                 "init_mean", "init_var")}
    yt = torch.tensor(y, requires_grad=True)
    inputs = (yt, *leaves.values())
    first = ks.filter(yt[..., :5, :], times=kw["times"][:5], backend=backend, **leaves)
    static = {k: v for k, v in leaves.items() if k not in ("init_mean", "init_var")}
    second = ks.filter(yt[..., 5:, :], times=kw["times"][5:], backend=backend, state=first, **static)
    got = torch.autograd.grad((first.loglik.sum() + second.loglik.sum() + second.mean.sum()), inputs)
    whole = ks.filter(yt, times=kw["times"], backend=backend, **leaves)
    want = torch.autograd.grad(whole.loglik.sum() + whole.mean[..., 5:, :].sum(), inputs)
    for g, w in zip(got, want):
        assert max_rel_error(g, w) < 1e-10

    state = first.state
    level = state.level.detach()

    def continued(mean, var):
        s = ks.StreamState(mean=mean, var=var, level=level, time=state.time, steps=state.steps)
        post = ks.filter(yt.detach()[..., 5:, :], times=kw["times"][5:], backend=backend, state=s,
                         **{k: v.detach() for k, v in static.items()})
        return post.loglik, post.mean

    assert torch.autograd.gradcheck(continued, (state.mean.detach().requires_grad_(),
                                                state.var.detach().requires_grad_()))


def test_state_kinds_and_shapes():
    """A NumPy state continues a torch call and the other way round; a Posterior is accepted; the
    state may add batch dimensions; nothing the caller passed is modified; the state owns its
    arrays (a copy, not a view of the chunk)."""
    y, kw = problem(8)
    kw.pop("init_mean"), kw.pop("init_var")
    first = ks.filter(y[0, :30], backend="reference", **kw)
    s_np = first.state
    saved = {k: np.copy(getattr(s_np, k)) for k in ("mean", "var", "level")}
    second = ks.filter(torch.tensor(y[0, 30:]), backend="torch", state=s_np, **kw)
    third = ks.filter(y[0, 30:], backend="cpu", state=ks.filter(torch.tensor(y[0, :30]), **kw), **kw)
    assert isinstance(second.mean, torch.Tensor) and isinstance(third.mean, np.ndarray)
    assert max_rel_error(second.mean, third.mean) < 1e-12
    assert all(np.array_equal(getattr(s_np, k), saved[k]) for k in saved)
    assert s_np.mean.base is None and s_np.var.base is None

    batch = ks.StreamState(mean=np.array([[0.5, 1.0, -1.0], [2.0, 0.0, 0.3]]), var=np.array([1.0, 2.0, 0.5]))
    out = ks.filter(y[0, :5], theta=0.5, sigma=1.0, obs_var=0.3, state=batch)
    assert out.mean.shape == (2, 5, 3)
    one = ks.StreamState(mean=batch.mean[1], var=batch.var)
    single = ks.filter(y[0, :5], theta=0.5, sigma=1.0, obs_var=0.3, state=one)
    assert max_rel_error(out.mean[1], single.mean) < 1e-15
    assert "after 0 steps" in repr(batch) and "after 5 steps" in repr(out.state)

    mean = torch.tensor(kw["mean"])
    state = ks.filter(torch.tensor(y[0, :1]), times=[0.5], **dict(kw, mean=mean)).state
    before = (state.level.clone(), state.time.clone())
    mean += 1.0  # an optimiser's step in place does not reach into the state
    assert torch.equal(state.level, before[0]) and torch.equal(state.time, before[1])


def test_dt_at_index_0_governs_the_transition():
    """With ``dt`` and a state, index 0 of the chunk has a transition over ``dt[0]``."""
    y = np.array([[1.0], [np.nan]])
    kw = dict(theta=0.7, sigma=1.3, obs_var=0.4)
    first = ks.filter(y[:1], backend="reference", **kw)
    later = ks.filter(y[1:], dt=2.5, backend="reference", state=first, **kw)
    decay, noise = ks.ou.discretize(0.7, 1.3, 2.5)
    assert np.isclose(later.pred_var[0, 0], decay**2 * first.var[0, 0] + noise, rtol=1e-14)
    assert np.isclose(later.pred_mean[0, 0], decay * first.mean[0, 0], rtol=1e-14)


def test_errors_name_the_state():
    y = np.zeros((4, 2))
    kw = dict(theta=0.5, sigma=1.0, obs_var=0.3)
    post = ks.filter(y, times=np.arange(4.0), **kw)
    with pytest.raises(ValueError, match="state and init_mean"):
        ks.filter(y, state=post, init_var=1.0, **kw)
    with pytest.raises(ValueError, match="state must be"):
        ks.filter(y, state=(np.zeros(2), np.ones(2)), **kw)
    with pytest.raises(ValueError, match="state.mean, state.var and state.level of shapes"):
        ks.StreamState(mean=np.zeros(3), var=np.ones(2))
    with pytest.raises(ValueError, match=r"state \(mean, var, level of shapes .*\) does not broadcast to \(2,\)"):
        ks.filter(y, state=ks.StreamState(mean=np.zeros(3), var=np.ones(3)), **kw)
    with pytest.raises(ValueError, match="state.var must be >= 0"):
        ks.filter(y, state=ks.StreamState(mean=np.zeros(2), var=np.array([1.0, np.nan])), **kw)
    with pytest.raises(ValueError, match="state.var must be >= 0"):
        ks.smooth(torch.zeros(4, 2), state=ks.StreamState(mean=torch.zeros(2), var=-torch.ones(2)), **kw)
    with pytest.raises(ValueError, match="state.mean - state.level must be finite"):
        ks.filter(y, state=ks.StreamState(mean=np.zeros(2), var=np.ones(2), level=np.inf), **kw)
    with pytest.raises(ValueError, match="times must start after state.time"):
        ks.filter(y, times=np.arange(4.0) + 3.0, state=post, **kw)
    with pytest.raises(ValueError, match="state.time is None"):
        ks.filter(y, times=np.arange(4.0), state=ks.filter(y, **kw), **kw)
    with pytest.raises(ValueError, match="state.steps"):
        ks.StreamState(mean=0.0, var=1.0, steps=-1)
    with pytest.raises(ValueError, match="state needs the filtered mean and var"):
        ks.filter(y, outputs=("loglik",), **kw).state
    later = ks.filter(y, times=np.arange(4.0) + 3.5, state=post, **kw)  # continues after time 3
    assert later.state.steps == 8 and float(later.state.time[0]) == 6.5


def test_docs_api_streaming_example_runs():
    for block in api_examples("state=state"):
        exec(compile(block, "docs/api.md", "exec"), {})
