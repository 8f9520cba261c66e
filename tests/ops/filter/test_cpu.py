"""The ``"cpu"`` backend (compiled numba loops, :mod:`kalmanscan.ops.filter.cpu`): equal to the
float64 covariance-form reference, its gradients equal to the torch backend's and to finite
differences, the smoother equal to a sequential RTS loop, float32 within a measured bound, the
same bits on 1 and 2 threads, inputs untouched, and nothing compiled at import."""

import dataclasses
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch
from helpers import POSITIVE, max_rel_error, random_problem, rel_error, to_np

import kalmanscan as ks
from kalmanscan.problem.prepare import prepare
from kalmanscan.tuning import tuned
from kalmanscan.ops.filter.cpu import backend as cpu
from kalmanscan.ops.filter import reference as reference_backend
from kalmanscan.ops.filter import torch as torch_backend

FIELDS = cpu.FIELDS[:9]  # the differentiable fields (missing is 0/1)
# Worst float32 error against the float64 reference over 48 random problems (T up to 5000,
# static and per-step parameters, times, 10% missing) was 5.0e-7 (relative, on the variance;
# y itself rounded to float32 included); the bound keeps a factor of 8 and is the torch
# backend's float32 bound (tests/test_filter.py).
FLOAT32_BOUND = 4e-6


def reference(y, kw):
    """The float64 reference backend's dict of NumPy arrays for the NumPy problem ``(y, kw)``."""
    return {k: np.asarray(to_np(v)) for k, v in reference_backend.filter(prepare(y, **kw)).items()}


def filter_torch(p):
    return torch_backend.filter(p)


def errors(out, ref, shape):
    """Worst relative error per field (elementwise for positive ones, max-norm for signed)."""
    errs = {}
    for k in FIELDS:
        fn = rel_error if k in POSITIVE else max_rel_error
        errs[k] = fn(np.broadcast_to(to_np(out[k]), shape), np.broadcast_to(ref[k], shape))
    errs["loglik"] = max_rel_error(to_np(out["logliks"]).sum(-2), np.broadcast_to(ref["logliks"], shape).sum(-2))
    for k in ("decay", "noise"):
        errs[k] = rel_error(np.broadcast_to(to_np(out[k]), shape), np.broadcast_to(ref[k], shape))
    assert np.array_equal(np.broadcast_to(to_np(out["missing"]), shape), np.broadcast_to(ref["missing"], shape))
    return max(errs.values()), errs


def check_reference(y, kw, bound=1e-10):
    p = prepare(y, **kw)
    out = cpu.filter(p)
    assert all(out[k].dtype == torch.float64 for k in out)
    err, errs = errors(out, reference(y, kw), p.shape)
    assert err < bound, errs
    return out


@pytest.mark.parametrize("T", [1, 63, 1000])
@pytest.mark.parametrize("per_step", [False, True])
@pytest.mark.parametrize("times", [False, True])
def test_equals_reference_float64(T, per_step, times):
    rng = np.random.default_rng(2200 + 1000 * T + 10 * per_step + times)
    y, kw = random_problem(rng, T, per_step=per_step, times=times)
    check_reference(y, kw)


def test_missing_leading_trailing_and_whole_channels():
    rng = np.random.default_rng(1)
    y, kw = random_problem(rng, 40, C=4, missing=0.2)
    y[:, :5, 0] = np.nan
    y[:, -7:, 1] = np.nan
    y[:, :, 2] = np.nan
    out = check_reference(y, kw)
    assert torch.all(out["logliks"][:, :, 2] == 0) and torch.all(out["missing"][:, :, 2] == 1)
    # a missing step is a pure prediction
    assert torch.equal(out["mean"][:, :5, 0], out["pred_mean"][:, :5, 0])


def test_offsets_1e4():
    rng = np.random.default_rng(2)
    for per_step in (False, True):
        y, kw = random_problem(rng, 300, per_step=per_step, offset=1e4)
        check_reference(y, kw)


def test_extreme_theta_dt_and_obs_var():
    """theta dt from 1e-8 (random walk limit, the Taylor branch of phi) to 1e3 (decay underflows
    to 0), across obs_var 1e-8 .. 1e8, in one call: theta over a batch axis, obs_var over
    channels, static parameters broadcast (never copied)."""
    rng = np.random.default_rng(3)
    dt = 0.7
    theta_dt = np.array([1e-8, 3e-5, 5e-5, 1e-4, 0.3, 30.0, 1e3])
    obs_var = np.array([1e-8, 1e-3, 1.0, 1e4, 1e8])
    theta = (theta_dt / dt)[:, None, None]
    y = 1e4 + rng.normal(size=(len(theta_dt), 65, len(obs_var))) * np.sqrt(obs_var)
    y[rng.random(y.shape) < 0.2] = np.nan
    kw = dict(theta=theta, sigma=2.0, obs_var=obs_var, mean=1e4, dt=dt, init_var=3.0)
    check_reference(y, kw)


def test_random_walk_and_batch_dims_with_times_per_batch():
    rng = np.random.default_rng(4)
    T = 50
    y = rng.normal(size=(T, 2))
    times = np.cumsum(rng.uniform(0.1, 2, (3, T, 1)), axis=1)
    kw = dict(theta=np.array([0.0, 0.4]), sigma=rng.uniform(0.2, 1, (3, 1, 2)), obs_var=[0.3, 0.9],
              times=times, h=1.5, init_var=[10.0, 2.0], init_mean=0.5)
    out = check_reference(y, kw)
    assert out["mean"].shape == (3, T, 2)


def test_no_process_noise_and_empty_batch():
    rng = np.random.default_rng(14)
    check_reference(rng.normal(size=(2, 200, 2)), dict(theta=[0.5, 0.0], sigma=0.0, obs_var=0.5, init_var=1.0))
    out = cpu.filter(prepare(np.zeros((0, 5, 2)), theta=0.3, sigma=1.0, obs_var=0.5))
    assert out["mean"].shape == (0, 5, 2) and cpu.smooth(out)[0].shape == (0, 5, 2)


def test_float32_within_measured_bound():
    rng = np.random.default_rng(9)
    worst = 0.0
    for T in (1, 63, 1000):
        y, kw = random_problem(rng, T, per_step=T > 1, times=True)
        p = prepare(y.astype(np.float32), **kw)
        out = cpu.filter(p)
        assert all(out[k].dtype == torch.float32 for k in out)
        worst = max(worst, errors(out, reference(y, kw), p.shape)[0])
    assert worst < FLOAT32_BOUND


def test_reads_inputs_in_place():
    """y and the per-step parameters are read through views of the caller's memory; static ones
    are read at their own size, not broadcast copies."""
    rng = np.random.default_rng(5)
    y, kw = random_problem(rng, 30, per_step=False)
    yt = torch.tensor(y)
    p = prepare(yt, **kw)
    arrays, boff, tstride, cstride = cpu.layout([getattr(p, k) for k in cpu.INPUTS], p.shape, np.float64)
    assert np.shares_memory(arrays[0], yt.numpy()) and arrays[1].size == 3
    assert tstride[1] == 0 and tstride[0] == 3 and list(boff[:, 0]) == [0, 90]


def _weights(out, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.rand(torch.broadcast_shapes(out[k].shape, out["mean"].shape), generator=g,
                          dtype=out[k].dtype) for k in FIELDS + ("decay", "noise")}


def _loss(out, w):
    return sum((out[k] * w[k]).sum() for k in w)


GRAD_CASES = [
    dict(T=40, per_step=False, times=False, defaults=True),
    dict(T=33, per_step=True, times=True, defaults=False),
    dict(T=1, per_step=False, times=False, defaults=False),
    dict(T=25, per_step=False, times=True, defaults=False),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_gradients_equal_torch_backend(case):
    rng = np.random.default_rng(6 + case["T"])
    y, kw = random_problem(rng, case["T"], per_step=case["per_step"], times=case["times"], missing=0.2)
    if case["defaults"]:
        del kw["init_mean"], kw["init_var"]  # stationary init: init_var's gradient reaches theta
    results = []
    for fn in (cpu.filter, filter_torch):
        leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in kw.items()}
        yt = torch.tensor(y, requires_grad=True)
        out = fn(prepare(yt, **leaves))
        loss = _loss(out, _weights(out))
        results.append((loss, torch.autograd.grad(loss, [yt, *leaves.values()])))
    (l_cpu, g_cpu), (l_torch, g_torch) = results
    assert abs(l_cpu.item() - l_torch.item()) < 1e-10 * abs(l_torch.item())
    for name, a, b in zip(["y", *kw], g_cpu, g_torch):
        assert a.shape == b.shape, name
        scale = max(b.abs().max().item(), 1e-3)
        assert (a - b).abs().max().item() < 1e-9 * scale, name


def test_gradients_broadcast_parameters_and_times_per_batch():
    """y (T, C) under parameters with batch dimensions, per-step obs_var, times per batch, a random
    walk channel (theta = 0): every gradient reduced to its argument's own shape."""
    rng = np.random.default_rng(15)
    T = 20
    y = rng.normal(size=(T, 2))
    y[3, 0] = np.nan
    kw = dict(theta=np.array([0.0, 0.4]), sigma=rng.uniform(0.2, 1, (3, 1, 2)), obs_var=rng.uniform(0.2, 1, (T, 2)),
              times=np.cumsum(rng.uniform(0.1, 2, (3, T, 1)), axis=1), h=1.5, init_var=[10.0, 2.0],
              init_mean=0.5, mean=rng.normal(size=(3, 1, 1)))
    results = []
    for fn in (cpu.filter, filter_torch):
        leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in kw.items()}
        yt = torch.tensor(y, requires_grad=True)
        out = fn(prepare(yt, **leaves))
        results.append(torch.autograd.grad(_loss(out, _weights(out)), [yt, *leaves.values()]))
    for name, a, b in zip(["y", *kw], *results):
        assert a.shape == b.shape, name
        assert (a - b).abs().max().item() < 1e-9 * max(b.abs().max().item(), 1e-3), name


def test_gradcheck_small_problem():
    rng = np.random.default_rng(7)
    y, kw = random_problem(rng, 6, C=2, batch=(2,), per_step=False, missing=0.2)
    names = ("theta", "sigma", "obs_var", "mean", "h", "dt", "init_mean", "init_var")
    leaves = [torch.tensor(kw[k], dtype=torch.float64, requires_grad=True) for k in names]
    yt = torch.tensor(y, requires_grad=True)

    def f(y, *params):
        out = cpu.filter(prepare(y, **dict(zip(names, params))))
        return tuple(out[k] for k in FIELDS)

    assert torch.autograd.gradcheck(f, (yt, *leaves), atol=1e-7, rtol=1e-6, fast_mode=True)


def test_double_backward_raises():
    y = torch.tensor([[1.0], [0.5]], dtype=torch.float64)
    theta = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    out = cpu.filter(prepare(y, theta=theta, sigma=1.0, obs_var=0.5))
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(out["logliks"].sum(), theta, create_graph=True)
    mean_s, _, _ = cpu.smooth(out)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(mean_s.sum(), theta, create_graph=True)


def _rts_loop(f):
    """The RTS smoother as a sequential float64 NumPy loop (centred, as ks.smooth)."""
    g = {k: np.asarray(to_np(v), dtype=np.float64) for k, v in f.items()}
    shape = g["mean"].shape
    a, q = (np.broadcast_to(g[k], shape) for k in ("decay", "noise"))
    mean_s, var_s = g["mean"].copy(), g["var"].copy()
    for t in range(shape[-2] - 2, -1, -1):
        pv = g["pred_var"][..., t + 1, :]
        J = a[..., t + 1, :] * g["var"][..., t, :] / pv
        mean_s[..., t, :] = g["mean"][..., t, :] + J * (mean_s[..., t + 1, :] - g["pred_mean"][..., t + 1, :])
        var_s[..., t, :] = J * J * var_s[..., t + 1, :] + g["var"][..., t, :] * q[..., t + 1, :] / pv
    return mean_s, var_s


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_smoother_equals_sequential_loop(dtype):
    rng = np.random.default_rng(8)
    for T, per_step in ((1, False), (63, True), (500, False)):
        y, kw = random_problem(rng, T, per_step=per_step, times=per_step, offset=1e4 * per_step)
        p = prepare(y.astype(dtype), **kw)
        f = cpu.filter(p)
        mean_s, var_s, prec_s = cpu.smooth(f, p.mean)
        ref_mean, ref_var = _rts_loop(f)
        bound = 1e-10 if dtype == np.float64 else FLOAT32_BOUND
        assert max_rel_error(mean_s, ref_mean) < bound and rel_error(var_s, ref_var) < bound
        assert rel_error(prec_s, 1.0 / ref_var) < bound
        torch.testing.assert_close(mean_s[..., -1, :], f["mean"][..., -1, :], rtol=0, atol=0)


def _rts_torch_loop(mean, var, pred_mean, pred_var, decay, noise):
    """The smoother as a differentiable torch loop (autograd reference)."""
    shape = mean.shape
    a, q = torch.broadcast_to(decay, shape), torch.broadcast_to(noise, shape)
    ms, vs = [mean[..., -1, :]], [var[..., -1, :]]
    for t in range(shape[-2] - 2, -1, -1):
        J = a[..., t + 1, :] * var[..., t, :] / pred_var[..., t + 1, :]
        ms.append(mean[..., t, :] + J * (ms[-1] - pred_mean[..., t + 1, :]))
        vs.append(J * J * vs[-1] + var[..., t, :] * q[..., t + 1, :] / pred_var[..., t + 1, :])
    mean_s, var_s = torch.stack(ms[::-1], -2), torch.stack(vs[::-1], -2)
    return mean_s, var_s, 1.0 / var_s


@pytest.mark.parametrize("per_step", [False, True])
def test_smoother_gradients(per_step):
    rng = np.random.default_rng(10 + per_step)
    y, kw = random_problem(rng, 12, C=2, per_step=per_step, times=per_step, missing=0.2)
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in kw.items()}
    yt = torch.tensor(y, requires_grad=True)
    p = prepare(yt, **leaves)
    f = cpu.filter(p)
    results = []
    for fn in (lambda: cpu.smooth(f, p.mean), lambda: _rts_torch_loop(*(f[k] for k in cpu.SMOOTH_INPUTS))):
        out = fn()
        w = [torch.rand(x.shape, generator=torch.Generator().manual_seed(i), dtype=x.dtype) for i, x in enumerate(out)]
        loss = sum((x * wi).sum() for x, wi in zip(out, w))
        results.append(torch.autograd.grad(loss, [yt, *leaves.values()], retain_graph=True))
    for name, a, b in zip(["y", *kw], *results):
        assert (a - b).abs().max().item() < 1e-9 * max(b.abs().max().item(), 1e-3), name

    # gradcheck of the smoother alone on a small filter output (per-step decay and noise)
    f = {k: v.detach()[:1, :5].clone().requires_grad_() if v.shape[-2] > 1 else v.detach().clone().requires_grad_()
         for k, v in f.items() if k in cpu.SMOOTH_INPUTS}
    assert torch.autograd.gradcheck(lambda *xs: cpu.smooth(dict(zip(cpu.SMOOTH_INPUTS, xs))),
                                    tuple(f[k] for k in cpu.SMOOTH_INPUTS), atol=1e-7, rtol=1e-6,
                                    fast_mode=True)


def test_thread_counts_give_identical_bits():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has a single thread here")
    with tuned(small_work=0):  # small problems run on one thread otherwise
        rng = np.random.default_rng(11)
        y, kw = random_problem(rng, 50, C=7, batch=(5,), per_step=False, missing=0.1)
        before = numba.get_num_threads()
        runs = []
        try:
            for threads in (1, 2):
                numba.set_num_threads(threads)
                leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in kw.items()}
                yt = torch.tensor(y, requires_grad=True)
                p = prepare(yt, **leaves)
                out = cpu.filter(p)
                mean_s, var_s, _ = cpu.smooth(out, p.mean)
                loss = _loss(out, _weights(out)) + mean_s.sum() + var_s.sum()
                grads = torch.autograd.grad(loss, [yt, *leaves.values()])
                runs.append([out[k].detach() for k in cpu.FIELDS] + [mean_s.detach(), var_s.detach(), *grads])
        finally:
            numba.set_num_threads(before)
        for a, b in zip(*runs):
            assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


def test_inputs_not_modified():
    rng = np.random.default_rng(12)
    y, kw = random_problem(rng, 25, per_step=True, times=True)
    copies = {k: np.copy(v) for k, v in kw.items()}
    y_copy = np.copy(y)
    yt = torch.tensor(y, requires_grad=True)
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in kw.items()}
    leaf_copies = {k: v.detach().clone() for k, v in leaves.items()}
    for args in ((y, kw), (yt, leaves)):
        p = prepare(args[0], **args[1])
        out = cpu.filter(p)
        mean_s, var_s, _ = cpu.smooth(out, p.mean)
        if out["mean"].requires_grad:
            (out["logliks"].sum() + mean_s.sum()).backward()
    np.testing.assert_array_equal(y, y_copy)
    assert torch.equal(torch.nan_to_num(yt.detach(), 7.0), torch.nan_to_num(torch.tensor(y_copy), 7.0))
    for k in kw:
        np.testing.assert_array_equal(kw[k], copies[k])
        assert torch.equal(leaves[k].detach(), leaf_copies[k])


def test_outputs_subset_and_errors():
    rng = np.random.default_rng(13)
    y, kw = random_problem(rng, 20)
    p = prepare(y, **kw)
    full = cpu.filter(p)
    part = cpu.filter(p, outputs=("mean", "var"))
    assert set(part) == {"mean", "var"}  # decay and noise only with every field (the callers take the problem's)
    assert torch.equal(part["mean"], full["mean"]) and torch.equal(part["var"], full["var"])
    with pytest.raises(ValueError, match="outputs"):
        cpu.filter(p, outputs=("mean", "nope"))
    with pytest.raises(ValueError, match="float32 or float64"):
        cpu.filter(dataclasses.replace(p, y=p.y.to(torch.bfloat16)))


def test_import_compiles_nothing():
    code = ("import sys, kalmanscan, kalmanscan.ops.filter.cpu; "
            "print('numba' in sys.modules, 'kalmanscan.ops.filter.cpu.loops' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"]


@pytest.fixture
def poisoned_numpy(monkeypatch):
    """Every array the backend allocates through NumPy starts as NaN: an element left unwritten shows."""
    empty = np.empty

    def nan_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        if x.dtype.kind == "f":
            x.fill(np.nan)
        return x

    monkeypatch.setattr(np, "empty", nan_empty)


@pytest.mark.parametrize("T", [1, 63, 1000])
def test_poisoned_outputs_are_all_written(poisoned_numpy, T):
    rng = np.random.default_rng(16 + T)
    for per_step in (False, True):
        y, kw = random_problem(rng, T, per_step=per_step, missing=0.1)
        check_reference(y, kw)
        p = prepare(y, **kw)
        part = cpu.filter(p, outputs=("logliks", "var"))
        assert torch.isfinite(part["logliks"]).all() and torch.isfinite(part["var"]).all()


def test_static_loop_equals_general_loop_bit_for_bit():
    """Parameters given per step with equal values run the general loop; the same as static ones
    run the static loop (its cached variance terms): the same bits."""
    rng = np.random.default_rng(17)
    y, kw = random_problem(rng, 300, C=4, missing=0.1)
    T = y.shape[-2]
    with tuned(numpy_work=0):  # the compiled loops (this small work runs in Python floats otherwise)
        static = cpu.filter(prepare(y, **kw))
        per_step = {**kw, "obs_var": np.broadcast_to(kw["obs_var"], (T, 4)).copy()}
        general = cpu.filter(prepare(y, **per_step))
    for k in cpu.FIELDS:
        assert torch.equal(torch.nan_to_num(static[k], 7.0), torch.nan_to_num(general[k], 7.0)), k


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_converged_vector_steps_equal_general_loop_bit_for_bit(dtype):
    """Long stretches without missing values, so the static loop's tasks (16 adjacent series each)
    reach their variance's fixed point or two-value cycle and run the vectorised steps; a missing
    value, a gap across every series and a series missing for a stretch send steps back to the
    per-series path and the tasks converge again: every output the same bits as the general loop."""
    rng = np.random.default_rng(19)
    y, kw = random_problem(rng, 400, C=64, missing=0.0)
    y[..., 150, 3] = np.nan
    y[..., 200:205, :] = np.nan
    y[1, 260:300, 40] = np.nan
    y, kw = y.astype(dtype), {k: v.astype(dtype) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    T = y.shape[-2]
    static = cpu.filter(prepare(y, **kw))
    general = cpu.filter(prepare(y, **{**kw, "obs_var": np.broadcast_to(kw["obs_var"], (T, 64)).copy()}))
    for k in cpu.FIELDS:
        assert torch.equal(torch.nan_to_num(static[k], 7.0), torch.nan_to_num(general[k], 7.0)), k


def test_gradients_with_outputs_subset_equal_full():
    """Asking for the log-likelihoods alone (what ks.fit does) writes fewer fields, same gradients."""
    rng = np.random.default_rng(18)
    y, kw = random_problem(rng, 41, per_step=True, missing=0.2)
    grads = []
    for outputs in (None, ("logliks",), ("missing", "logliks", "mean")):
        leaves = {k: torch.tensor(v, requires_grad=True) for k, v in kw.items()}
        out = cpu.filter(prepare(torch.tensor(y), **leaves), outputs=outputs)
        assert outputs is None or set(out) == set(outputs)
        grads.append(torch.autograd.grad(out["logliks"].sum(), list(leaves.values())))
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_compiled_first_call_and_no_recompiles():
    """``torch.compile`` of a function calling ``ks.filter`` on the cpu backend: as a process's
    first call of the loops (Dynamo does not trace into numba's dispatcher: run_loop is opaque to
    it), equal to eager; and calls with the same tensors compile nothing new."""
    code = ("import torch, kalmanscan as ks\n"
            "f = lambda y: ks.filter(y, theta=0.1, sigma=0.5, obs_var=1.0).loglik\n"
            "y = torch.randn(2, 20, 3)\n"
            "print(torch.allclose(torch.compile(f, backend='aot_eager')(y), f(y)))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.split()[-1] == "True", res.stderr[-2000:]

    from torch._dynamo.utils import counters

    def f(y, theta):
        return ks.filter(y, theta=theta, sigma=0.5, obs_var=1.0, backend="cpu").loglik.sum()

    y, theta = torch.randn(2, 20, 3), torch.tensor([0.1, 0.3, 0.5], requires_grad=True)
    compiled = torch.compile(f, backend="aot_eager")
    torch.testing.assert_close(compiled(y, theta), f(y, theta))
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(3):
        compiled(y, theta)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("T", [20, 4000])
def test_a_call_leaves_torchs_thread_count_as_the_caller_set_it(T):
    """Under numba's OpenMP layer numba and torch share one runtime, where numba's
    ``set_num_threads`` also sets the count torch reads: a call on numba's threads (T = 4000) or on
    one thread (T = 20), forward and backward, leaves ``torch.get_num_threads()`` as it was."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        theta = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64, requires_grad=True)
        y = torch.randn(3, T, 4, dtype=torch.float64)
        ks.filter(y, theta=theta, sigma=0.5, obs_var=1.0, backend="cpu").loglik.sum().backward()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
