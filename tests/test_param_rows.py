"""Static parameters given as device tensors, checked and derived by one launch (``param_rows``).

The launch runs where the kernels do (:data:`helpers.KERNEL_DEVICE`: the interpreter on the CPU, compiled on
a GPU): :func:`prepare_static` gives the fields, derived rows
and facts of the host path (``prepare`` with the same values as NumPy), raises its messages for bad
values in its order, keeps gradients, and ``ks.filter`` through it (the GPU gate lifted) equals the
torch backend."""

import importlib
import inspect

import numpy as np
import pytest
import torch
import triton.language as tl

import kalmanscan as ks
from kalmanscan import tuning
from kalmanscan.kernels.filter.params import param_rows_kernel
from kalmanscan.problem.checks import Checks, Flag
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton.param_rows import prepare_static, static_on_device
from helpers import KERNEL_DEVICE, synchronisations

param_rows = importlib.import_module("kalmanscan.ops.filter.triton.param_rows")

T, C = 31, 5
ROWS = ("theta", "sigma", "obs_var", "mean", "h", "dt", "init_mean", "init_var")


def values(seed=0, dtype=torch.float32, **over):
    g = torch.Generator().manual_seed(seed)
    vals = dict(theta=torch.rand(C, dtype=dtype, generator=g) + 0.1, sigma=0.5,
                obs_var=torch.rand(C, dtype=dtype, generator=g) + 0.2, mean=torch.tensor(0.3, dtype=dtype),
                h=np.linspace(0.5, 1.5, C), dt=0.7, init_mean=None, init_var=None)
    vals.update(over)
    return {k: v.to(KERNEL_DEVICE) if isinstance(v, torch.Tensor) and not v.requires_grad else v
            for k, v in vals.items()}


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).to(KERNEL_DEVICE)


def host(vals):
    return {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in vals.items()}


def static(y, vals):
    checks = Checks()
    p, facts = prepare_static(y, vals, checks, False, y.dtype)
    verdict = checks.queue()
    return p, {k: bool(v.vector[v.index]) for k, v in facts.items()}, verdict


CASES = {
    "stationary prior": {},
    "given prior": dict(init_mean=torch.full((C,), -0.2), init_var=2.0),
    "diffuse prior": dict(init_var=torch.tensor([1.0, float("inf"), 1.0, 2.0, 3.0])),
    "no process noise": dict(sigma=torch.zeros(C), init_var=1.0),
    "random walk": dict(theta=0.0, init_var=torch.full((C,), 4.0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_rows_and_facts_equal_the_host_path(case, dtype):
    vals = values(dtype=dtype, **CASES[case])
    y = randn(T, C, dtype=dtype)
    p, facts, verdict = static(y, vals)
    verdict.decide()
    ref = prepare(y, backend="torch", **host(vals))
    for k in ROWS:
        torch.testing.assert_close(getattr(p, k).expand(1, C), getattr(ref, k).expand(1, C), rtol=0, atol=0)
    ulps = 4 * torch.finfo(dtype).eps  # decay and noise by Kahan's phi, not expm1: a few ulps apart
    for got, want in zip((*p.decay_noise(), *p.initial_info()), (*ref.decay_noise(), *ref.initial_info())):
        torch.testing.assert_close(got.expand(1, C), want.expand(1, C), rtol=ulps, atol=0)
    assert facts == dict(diffuse=ref.diffuse, no_noise=ref.no_process_noise())
    assert p.shape == ref.shape


def test_noise_bound_is_a_compile_time_constant():
    """A float argument reaches a compiled kernel as float32, where float64's bound (1e-290) is 0 and
    a float64 problem without process noise would not be flagged (seen on an H100; the interpreter
    passes Python floats as float64, so the tests above pass there either way)."""
    assert inspect.signature(param_rows_kernel.fn).parameters["bound"].annotation is tl.constexpr


BAD = [
    (dict(theta=torch.tensor([0.1, -1.0, 0.2, 0.3, 0.4])), "theta must be finite and >= 0"),
    (dict(sigma=torch.tensor(float("nan"))), "sigma must be finite and >= 0"),
    (dict(obs_var=0.0), "obs_var must be finite and > 0"),
    (dict(mean=torch.full((C,), float("inf"))), "mean must be finite"),
    (dict(h=torch.tensor(float("-inf"))), "h must be finite"),
    (dict(dt=torch.zeros(C)), "dt must be finite and > 0"),
    (dict(theta=torch.zeros(C)), "init_var is required when theta = 0"),
    (dict(sigma=torch.zeros(C)), "init_var is required where sigma = 0"),
    (dict(init_var=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])), "init_var must be > 0"),
    (dict(init_var=torch.tensor(float("nan"))), "init_var must be > 0"),
    (dict(init_mean=torch.full((C,), float("nan"))), "init_mean must be finite"),
    (dict(theta=torch.full((C,), -1.0), obs_var=-1.0), "theta must be"),  # the first in order
]


@pytest.mark.parametrize("bad, message", BAD)
def test_bad_values_raise_naming_the_argument(bad, message):
    y = randn(T, C)
    _, _, verdict = static(y, values(**bad))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        verdict.decide()


def test_shapes_are_checked_on_the_host():
    y = randn(T, C)
    with pytest.raises(ValueError, match="theta of shape"):
        static(y, values(theta=torch.rand(C + 1)))
    with pytest.raises(ValueError, match="init_var of shape"):
        static(y, values(init_var=torch.rand(C + 2)))


def test_host_values_are_kept_by_value_and_layout_not_the_tensors():
    """The host's rows are made once for a layout and values (``_DEVICE_ROWS``): a repeated call
    reads its new device tensors, changed host values or shapes make rows of their own, a bad host
    value raises on every call, and nothing returned shares the kept rows."""
    kept = param_rows._DEVICE_ROWS
    kept.clear()
    y = randn(T, C)

    def equal_to_host_path(vals):
        p, _, verdict = static(y, vals)
        verdict.decide()
        ref = prepare(y, backend="torch", **host(vals))
        for k in ROWS:
            torch.testing.assert_close(getattr(p, k).expand(1, C), getattr(ref, k).expand(1, C), rtol=0, atol=0)
        return p

    first = equal_to_host_path(values(seed=0))
    first.sigma.add_(1.0)  # written by the caller: the next call's rows are its own
    equal_to_host_path(values(seed=0))  # the same values, new tensors
    assert len(kept) == 1
    equal_to_host_path(values(seed=1))  # new values of theta and obs_var (on a GPU: read, not keyed)
    n = len(kept)
    equal_to_host_path(values(seed=1, sigma=0.9, h=np.linspace(0.5, 2.0, C)))
    equal_to_host_path(values(seed=1, dt=np.float32(0.7)))  # the same number as another type: a key of its own
    assert len(kept) == n + 2
    for _ in range(2):
        with pytest.raises(ValueError, match="obs_var must be finite and > 0"):
            static(y, values(obs_var=-1.0))[2].decide()
        with pytest.raises(ValueError, match="theta of shape"):
            static(y, values(theta=torch.rand(C + 1, device=KERNEL_DEVICE)))
    n = len(kept)
    equal_to_host_path(values(seed=2, theta=torch.rand(1, device=KERNEL_DEVICE) + 0.1))  # another layout
    assert len(kept) == n + 1


def test_gradients_reach_the_tensors_given():
    y = randn(T, C, dtype=torch.float64)
    theta = torch.rand(C, dtype=torch.float64, device=KERNEL_DEVICE) + 0.2
    sigma = torch.tensor(0.6, dtype=torch.float64, requires_grad=True, device=KERNEL_DEVICE)
    theta.requires_grad_()
    p, _, verdict = static(y, values(dtype=torch.float64, theta=theta, sigma=sigma))
    verdict.decide()
    assert p.derived is None
    (p.theta.sum() + 2 * p.init_var.sum()).backward()
    want = 1 - 2 * 0.6 ** 2 / (2 * theta.detach() ** 2)
    torch.testing.assert_close(theta.grad, want, rtol=1e-13, atol=0)
    torch.testing.assert_close(sigma.grad, (2 * 0.6 / theta.detach()).sum(), rtol=1e-13, atol=0)


def test_only_gpu_data_without_times_and_with_static_parameters():
    vals = values()
    assert not static_on_device(torch.zeros(3, C), vals, None)
    if torch.cuda.is_available():
        y = torch.zeros(3, C, device="cuda")
        assert static_on_device(y, vals, None)
        assert not static_on_device(y, vals, np.arange(3.0))
        assert not static_on_device(y, dict(vals, theta=torch.rand(3, C)), None)


@pytest.mark.parametrize("case", ["stationary prior", "given prior", "diffuse prior", "no process noise"])
def test_filter_through_it_equals_the_torch_backend(monkeypatch, case):
    monkeypatch.setattr(param_rows, "static_on_device", lambda y, vals, times: times is None)
    y = randn(T, C, dtype=torch.float64)
    y[3, 1] = float("nan")
    vals = {k: v for k, v in values(dtype=torch.float64, **CASES[case]).items() if v is not None}
    got = ks.filter(y, backend="triton", **vals)
    want = ks.filter(y, backend="torch", **host(vals))
    for k in ("mean", "var", "pred_mean", "pred_var", "logliks"):
        torch.testing.assert_close(getattr(got, k), getattr(want, k), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="obs_var must be"):
        ks.filter(y, backend="triton", **dict(vals, obs_var=torch.full((C,), -1.0, dtype=torch.float64,
                                                                       device=KERNEL_DEVICE)))


def test_large_y_with_static_device_parameters_is_checked_from_the_kernels(monkeypatch):
    """A ``y`` past the by-result limit with static device parameters: ``y``'s check comes from the
    aggregate pass (no reduction of ``y`` of its own), and an ``inf`` in ``y`` or a bad parameter
    still raises naming it."""
    prepare_module = importlib.import_module("kalmanscan.problem.prepare")
    monkeypatch.setattr(prepare_module, "host_parameters", lambda *args: False)  # as on a GPU
    monkeypatch.setattr(prepare_module, "static_on_device", lambda y, vals, times: times is None)
    y = randn(200, C, dtype=torch.float64)
    y[3, 1] = float("nan")
    vals = {k: v for k, v in values(dtype=torch.float64).items() if v is not None}
    with tuning.tuned(y_by_result=y.numel() - 1):
        p = prepare(y, backend="triton", late_y=True, defer=True, **vals)
        assert p.y_late and p.pending is not None
        got = ks.filter(y, backend="triton", **vals)
        want = ks.filter(y, backend="torch", **host(vals))
        torch.testing.assert_close(got.mean, want.mean, rtol=1e-10, atol=1e-12)
        bad = y.clone()
        bad[150, 4] = float("inf")
        with pytest.raises(ValueError, match="y must be finite"):
            ks.filter(bad, backend="triton", **vals)
        with pytest.raises(ValueError, match="obs_var must be"):
            ks.filter(y, backend="triton", **dict(vals, obs_var=torch.full((C,), -1.0, dtype=torch.float64,
                                                                           device=KERNEL_DEVICE)))


def test_flags_are_read_with_their_vector_in_order():
    """Verdicts and facts given as entries of one vector (``Flag``) come back with the scalar
    checks in one copy: the first failed check in the order added raises, facts read by name."""
    flags = torch.tensor([1, 0, 1, 1], dtype=torch.int8)
    checks = Checks()
    checks.require("a must hold", Flag(flags, 0))
    checks.require("b must hold", torch.tensor(True))
    checks.require("c must hold", Flag(flags, 2))
    checks.fact("d", Flag(flags, 3))
    checks.fact("e", Flag(flags, 1))
    checks.fact("f", True)
    assert checks.queue().decide() == dict(d=True, e=False, f=True)
    checks.require("a must hold", Flag(flags, 0))
    checks.require("g must hold", Flag(flags, 1))
    checks.require("h must hold", torch.tensor(False))
    with pytest.raises(ValueError, match="g must hold"):
        checks.decide()


@pytest.mark.gpu
def test_large_y_with_device_parameters_equals_numbers_and_is_checked():
    """Static device parameters and a ``y`` of more than ``BY_RESULT`` elements on the triton
    backend: the result equals the call with the same values given on the host (up to the ulps of
    decay and noise derived on the device), two waits a call, each while the kernels run and no
    pass over ``y`` of its own (the verdicts, queued before the kernels; ``y``'s check, from the
    aggregate pass as with host parameters), and an ``inf`` in ``y`` or a bad parameter raises
    naming it."""
    Cb = 512
    g = torch.Generator("cuda").manual_seed(5)
    y = torch.randn(600, Cb, device="cuda", generator=g)
    y[torch.rand(600, Cb, device="cuda", generator=g) < 0.1] = float("nan")
    theta = torch.rand(Cb, device="cuda", generator=g) + 0.1
    kw = dict(theta=theta, sigma=0.6, obs_var=torch.full((Cb,), 0.4, device="cuda"), backend="triton")
    got = ks.filter(y, outputs=("mean", "var"), **kw)
    want = ks.filter(y, outputs=("mean", "var"), **dict(kw, theta=theta.cpu().numpy(), obs_var=0.4))
    for k in ("mean", "var"):
        torch.testing.assert_close(getattr(got, k), getattr(want, k))
    assert synchronisations(lambda: ks.filter(y, **kw)) == 2
    bad = y.clone()
    bad[599, 511] = float("inf")
    with pytest.raises(ValueError, match="y must be finite"):
        ks.filter(bad, **kw)
    with pytest.raises(ValueError, match="obs_var must be"):
        ks.filter(y, **dict(kw, obs_var=torch.full((Cb,), -1.0, device="cuda")))
