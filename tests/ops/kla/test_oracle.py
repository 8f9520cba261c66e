"""The KLA scan at the edges of its range, against a 120-digit oracle (``tests/kla_oracle.py``):
no process noise with a fast decay (the exact precision grows like ``decay^(-2t)``), tiny and huge
observation precisions, extreme initial precisions; forward and every gradient, every backend; and
a randomized differential test of every backend against the reference and the oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kla_oracle
from helpers import KERNEL_DEVICE
from kalmanscan.model import mobius
from kalmanscan.ops.kla import kla_scan

FLOAT64_BACKENDS = ("reference", "torch", "recurrent", "cpu")


def edge_inputs(B, L, M, S, decay, noise, lam_v, lam0=1.0, seed=0):
    """Random ``v``, unit ``k``, ``q`` and initial mean ``eta0 / lam0``; the other inputs constant."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g, dtype=torch.float64), dim=-1)  # noqa: E731
    full = lambda shape, x: torch.full(shape, x, dtype=torch.float64)  # noqa: E731
    return [torch.randn(B, L, M, generator=g, dtype=torch.float64), full((B, L, M), lam_v), unit(B, L, S),
            unit(B, L, S), full((M, S), decay), full((M, S), noise), full((B, M, S), lam0),
            torch.randn(B, M, S, generator=g, dtype=torch.float64) * lam0]


def run(backend, xs, dtype=torch.float64, device="cpu"):
    """``(y, y_var, var, mu)`` and, under autograd, the gradients of a fixed functional of them."""
    a = [x.detach().to(dtype=dtype, device=device, copy=True).requires_grad_() for x in xs]
    y, y_var, state = kla_scan(*a[:6], initial_state=(a[6], a[7]), return_state=True, backend=backend)
    outs = [y, y_var, state.var, state.mu]
    loss = sum((o.double() * w.to(o.device)).sum() for o, w in zip(outs, weights(outs)))
    grads = torch.autograd.grad(loss, a)
    return [o.detach().double().cpu() for o in outs], dict(zip(kla_oracle.NAMES, (g.double().cpu() for g in grads)))


def weights(outs):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]


def rel(a, b, floor=0.0):
    """The RMS error of ``a`` against ``b`` relative to the larger of ``b``'s norm and ``floor``
    (0 when all are 0)."""
    scale = max(b.norm().item(), floor)
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


def check(got, want, tol, what, floors=None):
    """Every entry of ``got`` finite and within ``tol`` of ``want`` (:func:`rel`)."""
    for name in got:
        error = rel(got[name], want[name], (floors or {}).get(name, 0.0))
        assert torch.isfinite(got[name]).all(), f"{what}: {name} not finite"
        assert error <= tol, f"{what}: {name} off by {error:.3g}"


def as_dict(outs):
    return dict(zip(("y", "y_var", "var", "mu"), outs))


def test_no_noise_and_a_fast_decay_stay_finite_and_exact():
    """decay 1e-6 without process noise: the precision passes float64's range after 26 tokens (the
    reference in precision form returned NaN here); the mean and variance stay exact."""
    xs = edge_inputs(1, 300, 2, 16, decay=1e-6, noise=0.0, lam_v=1e4)
    want = as_dict(kla_oracle.scan(xs))
    with torch.no_grad():
        for backend in FLOAT64_BACKENDS:
            a = xs
            y, y_var, state = kla_scan(*a[:6], initial_state=(a[6], a[7]), return_state=True, backend=backend)
            check(as_dict([y, y_var, state.var, state.mu]), want, 1e-13, backend)


EDGES = {  # (B, L, M, S), decay, noise, lam_v, lam0
    "no noise, slow observations": ((1, 30, 1, 1), 0.1, 0.0, 1e-6, 1.0),
    "no noise, sharp observations": ((2, 9, 2, 3), 0.3, 0.0, 1e4, 1.0),
    "large initial precision": ((1, 6, 1, 2), 1 - 1e-9, 1e-3, 1.0, 1e12),
    "small initial precision": ((1, 6, 1, 2), 1 - 1e-9, 1e-3, 1.0, 1e-12),
    "no noise, large initial precision": ((1, 5, 2, 1), 1 - 1e-9, 0.0, 1.0, 1e12),
}


@pytest.mark.parametrize("edge", EDGES)
def test_float64_backends_against_the_oracle(edge):
    """Every gradient of the float64 backends within 1e-10 of the oracle's (the reference's noise
    gradient was 1e134 off in precision form at the first edge). The torch backend's initial-state
    gradients are bounded, not exact, for a small initial precision: see
    :func:`test_torch_initial_state_gradient_bound`."""
    shape, decay, noise, lam_v, lam0 = EDGES[edge]
    xs = edge_inputs(*shape, decay=decay, noise=noise, lam_v=lam_v, lam0=lam0)
    want_outs = as_dict(kla_oracle.scan(xs))
    want = kla_oracle.gradients(xs, weights(list(want_outs.values())))
    for backend in FLOAT64_BACKENDS:
        outs, grads = run(backend, xs)
        check(as_dict(outs), want_outs, 1e-13, f"{backend} outputs")
        if backend == "torch" and lam0 < 1:
            grads = {k: v for k, v in grads.items() if k not in ("lam0", "eta0")}
        check(grads, {k: want[k] for k in grads}, 1e-10, f"{backend} gradients")


FLOAT32_EDGES = {  # the edges above where float32 holds every quantity
    "large initial precision": EDGES["large initial precision"],
    "small initial precision": EDGES["small initial precision"],
    "no noise, large initial precision": EDGES["no noise, large initial precision"],
}


@pytest.mark.parametrize("backend", ["cpu", "recurrent", "triton"])
@pytest.mark.parametrize("edge", FLOAT32_EDGES)
def test_float32_backends_at_extreme_initial_precisions(backend, edge):
    """In float32 the initial state's gradients at ``lam0 = 1e12`` (about ``-1e-24``) and
    ``lam0 = 1e-12`` and the noise gradient keep float32's accuracy (they were 0 or wrong in sign:
    a cancellation in the adjoints, ``kernels/kla/bwd.py``, ``kalmanscan/ops/kla/cpu/loops.py``,
    :func:`kalmanscan.ops.kla.recurrent.posterior_var`); with this loss on the final state the fused
    kernels' noise gradient within their documented bound, which exceeds 1 without noise at
    ``lam0 = 1e12`` (:mod:`kalmanscan.ops.kla.triton.backend`; a loss on ``y`` and ``y_var`` alone:
    :func:`test_triton_gradients_of_the_outputs_at_float32_accuracy`)."""
    shape, decay, noise, lam_v, lam0 = FLOAT32_EDGES[edge]
    xs = edge_inputs(*shape, decay=decay, noise=noise, lam_v=lam_v, lam0=lam0)
    want_outs = as_dict(kla_oracle.scan(xs))
    want = kla_oracle.gradients(xs, weights(list(want_outs.values())))
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    outs, grads = run(backend, xs, torch.float32, device)
    check(as_dict(outs), want_outs, 1e-6, f"{backend} outputs")
    if backend == "triton":  # its documented bound, test_triton_noise_gradient_bound
        check({"noise": grads.pop("noise")}, {"noise": want["noise"]}, triton_bound(xs), "triton noise")
    check(grads, {k: want[k] for k in grads}, 1e-5, f"{backend} gradients")


def triton_bound(xs):
    """The triton backend's bound on the decay and noise gradients' relative error (float32), from
    :mod:`kalmanscan.ops.kla.triton.backend`: ``10 eps (1 + lam_max)``, ``lam_max`` the largest
    precision after the first token (:func:`largest_precision`)."""
    return 10 * torch.finfo(torch.float32).eps * (1 + largest_precision(xs))


@pytest.mark.parametrize("edge", FLOAT32_EDGES)
def test_triton_gradients_of_the_outputs_at_float32_accuracy(edge):
    """For a loss on ``y`` and ``y_var`` the fused kernels' gradients, decay and noise included,
    keep float32's accuracy at every edge (the noise gradient without noise at ``lam0 = 1e12`` was
    1.8e4 off while the backward carried ``gl``; ``kernels/kla/bwd.py``)."""
    shape, decay, noise, lam_v, lam0 = FLOAT32_EDGES[edge]
    xs = edge_inputs(*shape, decay=decay, noise=noise, lam_v=lam_v, lam0=lam0)
    outs = kla_oracle.scan(xs)
    ws = weights(outs)[:2] + [torch.zeros_like(o) for o in outs[2:]]
    want = kla_oracle.gradients(xs, ws)
    a = [x.to(dtype=torch.float32, device=KERNEL_DEVICE, copy=True).requires_grad_() for x in xs]
    y, y_var = kla_scan(*a[:6], initial_state=(a[6], a[7]), backend="triton")
    loss = sum((o.double() * w.to(o.device)).sum() for o, w in zip((y, y_var), ws))
    grads = dict(zip(kla_oracle.NAMES, (g.double().cpu() for g in torch.autograd.grad(loss, a))))
    check(grads, want, 1e-5, "triton gradients")


@pytest.mark.parametrize("noise", [1e-1, 1e-3, 1e-5])
def test_triton_noise_gradient_bound(noise):
    """A loss on the final state read as ``var``, ``mu`` reaches the fused kernels as cotangents of
    ``(lam, eta)`` that cancel where ``lam`` is large (up to ``1/noise`` plus the observations'
    ``phi``): the decay and noise gradients within the bound of :func:`triton_bound` (measured 1e-5
    at noise 1e-3, where the largest precision after the first token is about ``1 / noise``), the
    other gradients at float32's accuracy."""
    xs = edge_inputs(1, 6, 1, 2, decay=0.97, noise=noise, lam_v=1.0, lam0=1e12)
    want_outs = as_dict(kla_oracle.scan(xs))
    want = kla_oracle.gradients(xs, weights(list(want_outs.values())))
    _, grads = run("triton", xs, torch.float32, KERNEL_DEVICE)
    assert triton_bound(xs) < 20 * torch.finfo(torch.float32).eps / noise   # lam_max about 1 / noise
    check({"noise": grads.pop("noise")}, {"noise": want["noise"]}, triton_bound(xs), "noise")
    check(grads, {k: want[k] for k in grads}, 1e-5, "other gradients")


def test_torch_initial_state_gradient_bound():
    """The torch backend reads the variance from the initial one through the projective map
    ``(C + D var0) / (A + B var0)``, whose derivative in ``var0`` autograd forms as a difference
    of two terms of relative size ``1 + phi var0``: its initial-state gradients carry a relative
    error up to about ``eps (1 + phi var0)`` (``phi = lam_v k^2``, ``var0 = 1 / lam0``, ``eps`` the
    dtype's rounding), documented in :func:`kalmanscan.ops.kla.torch.kla_scan`; here within 100
    times that, in float64 and float32."""
    for lam0, dtype in ((1e-12, torch.float64), (1e-6, torch.float64), (1e-2, torch.float32), (1.0, torch.float32)):
        xs = edge_inputs(1, 6, 1, 2, decay=1 - 1e-9, noise=1e-3, lam_v=1.0, lam0=lam0)
        want_outs = as_dict(kla_oracle.scan(xs))
        want = kla_oracle.gradients(xs, weights(list(want_outs.values())), wrt=("lam0", "eta0"))
        _, grads = run("torch", xs, dtype)
        bound = 100 * torch.finfo(dtype).eps * (1 + 1 / lam0)
        for name in want:
            assert rel(grads[name], want[name]) <= bound, (lam0, dtype, name, rel(grads[name], want[name]))


def log_uniform(lo, hi):
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


@st.composite
def scans(draw, max_length=8):
    """Tiny random scans over the whole range: decay from 1e-6 to 1 (exactly 1 too), noise 0 or
    from 1e-12 to 10, observation precisions from 1e-6 to 1e4, initial precisions from 1e-12 to
    1e12."""
    B, L, M, S = draw(st.integers(1, 2)), draw(st.integers(1, max_length)), draw(st.integers(1, 2)), \
        draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)

    def per(shape, values):
        return torch.tensor([draw(values) for _ in range(math.prod(shape))], dtype=torch.float64).reshape(shape)

    decay = per((M, S), st.one_of(st.just(1.0), log_uniform(1e-6, 1.0)))
    noise = per((M, S), st.one_of(st.just(0.0), log_uniform(1e-12, 10.0)))
    lam_v = per((B, L, M), log_uniform(1e-6, 1e4))
    lam0 = per((B, M, S), log_uniform(1e-12, 1e12))
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g, dtype=torch.float64), dim=-1)  # noqa: E731
    return [torch.randn(B, L, M, generator=g, dtype=torch.float64), lam_v, unit(B, L, S), unit(B, L, S), decay,
            noise, lam0, torch.randn(B, M, S, generator=g, dtype=torch.float64) * lam0]


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scans())
def test_differential_float64(xs):
    """Every float64 backend against the oracle (outputs) and the reference (every gradient; the
    reference against the oracle on the edges above)."""
    want = as_dict(kla_oracle.scan(xs))
    ref_outs, ref_grads = run("reference", xs)
    check(as_dict(ref_outs), want, 1e-12, "reference outputs")
    for backend in FLOAT64_BACKENDS[1:]:
        outs, grads = run(backend, xs)
        check(as_dict(outs), want, 1e-12, f"{backend} outputs")
        if backend == "torch":  # the documented bound of its initial-state gradients
            tol = max(1e-9, 100 * torch.finfo(torch.float64).eps * (1 + float(xs[1].amax() / xs[6].amin())))
            check({n: grads.pop(n) for n in ("lam0", "eta0")}, ref_grads, tol, "torch initial state")
        check(grads, {k: ref_grads[k] for k in grads}, 1e-9, f"{backend} gradients")


@settings(max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scans(max_length=5))
def test_differential_triton(xs):
    """The fused kernels (float32; the interpreter on a CPU) through the checked call against the
    oracle's outputs and the reference's gradients on the same float32-rounded inputs, at float32's
    accuracy: the means ``y``, ``mu`` and the gradients relative to the larger of their norm and
    the inputs' unit scale (a float32 mean that is a difference of unit-size terms carries their
    rounding, ``eps`` relative to them), the variances relative to their own norm."""
    xs = [x.float().double() for x in xs]
    want = as_dict(kla_oracle.scan(xs))
    _, ref_grads = run("reference", xs)
    outs, grads = run("triton", xs, torch.float32, KERNEL_DEVICE)
    check(as_dict(outs), want, 1e-5, "triton outputs", floors=dict(y=1.0, mu=1.0))
    eps = torch.finfo(torch.float32).eps
    unit = dict.fromkeys(kla_oracle.NAMES, 1.0)
    v, lam_v, k, q, decay, noise, lam0, _ = xs
    if ((decay < 1) & (noise < mobius.noise_bound(torch.float32))).any():
        # the mean form of the torch backend runs instead (kla_scan): its bound, which the rounding
        # of the initial state carries into the decay and noise gradients too
        state_tol = max(1e-4, 10 * eps * (1 + float(lam_v.amax() / lam0.amin())))
        check({n: grads.pop(n) for n in ("lam0", "eta0", "decay", "noise")}, ref_grads, state_tol,
              "torch initial state, decay and noise", unit)
    else:  # the fused kernels' bound on the decay and noise gradients
        tol = max(1e-4, triton_bound(xs))
        check({n: grads.pop(n) for n in ("decay", "noise")}, ref_grads, tol, "triton decay and noise", unit)
    check(grads, {n: ref_grads[n] for n in grads}, 1e-4, "triton gradients", unit)


def largest_precision(xs):
    """The largest precision the filters reach after their first token (float64; inf beyond its
    range, where the checked call runs the mean form instead of the fused kernels)."""
    v, lam_v, k, q, decay, noise, lam, _ = xs
    top = 0.0
    with torch.no_grad():
        for t in range(v.shape[1]):
            lam = lam / (decay * decay + noise * lam) + lam_v[:, t, :, None] * k[:, t, None, :] ** 2
            top = max(top, float(lam.amax()))
    return top
