"""The fused filter backward: cotangents of unused outputs are absent (never read, exact
gradients), and the time-parallel tile backward for few long series (``fused.TILE_BWD``) against
float64 torch autograd and the walk backward. Kernels under TRITON_INTERPRET=1 on the CPU;
``stretches`` and ``tiles`` (tests/conftest.py) make small problems cross many stretches and tiles.
"""

import numpy as np
import pytest
import torch
from helpers import NAMES, Launches, forward_views, problem_tensors, random_problem

import kalmanscan as ks
from kalmanscan import fused
from kalmanscan.inputs import prepare


# Fields of the filter's result a loss may use -> which cotangents of the kernels' centred outputs
# (mu, lam, pred_mu, pred_var) it makes present.
COTANGENT_PATTERNS = {
    ("mean",): (True, False, False, False),
    ("precision",): (False, True, False, False),
    ("logliks",): (False, False, True, True),
    ("pred_mean",): (False, False, True, False),
    ("pred_var",): (False, False, False, True),
    ("mean", "precision", "pred_mean", "pred_var"): (True, True, True, True),
}


def _assert_gradients_equal(want, got):
    """Gradients of ``y`` and :data:`NAMES` as in the other gradient tests; where the loss does not
    depend on an input (torch's gradient is None: the precision alone does not depend on ``y``),
    the triton backend's must be None or zero."""
    for name, a, b in zip(("y",) + NAMES, want, got):
        if a is None:
            assert b is None or torch.all(b == 0), name
            continue
        assert torch.all(torch.isfinite(b)), name
        assert float((a - b).norm() / a.norm()) < 1e-10, name


def _gradients_of_fields(y, kw, weights, **options):
    """``{backend: gradients}`` of ``y`` and :data:`NAMES` (None where unused) of the loss
    ``sum((out[k] * w).sum() for k, w in weights.items())`` on the filter's result ``out``, on the
    torch backend and on the triton one (:func:`fused.filter_triton` with ``options``)."""
    grads = {}
    for backend in ("torch", "triton"):
        t = problem_tensors(kw, grad=True)
        y_t = torch.tensor(y, requires_grad=True)
        p = prepare(y_t, backend=backend, **t)
        out = fused.filter_triton(p, **options) if backend == "triton" else fused.filter_torch(p)
        loss = sum((out[k] * w).sum() for k, w in weights.items())
        grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in NAMES], allow_unused=True)
    return grads


@pytest.mark.parametrize("fields", list(COTANGENT_PATTERNS))
@pytest.mark.parametrize("T,stretch,per_step", [(63, 63, False), (63, 4, True), (201, 201, True), (201, 7, False)])
def test_absent_cotangents_gradients_equal_torch_autograd(fields, T, stretch, per_step, poisoned, monkeypatch):
    """A loss on some outputs only: the backward gets the others' cotangents as None, reads none of
    them (one stretch, and several through ``stretch``), and the gradients stay exact."""
    seen = []
    backward = fused.filter_backward

    def spy(views, init, mu, lam, cot, stretch=None):
        seen.append(tuple(g is not None for g in cot))
        return backward(views, init, mu, lam, cot, stretch)

    monkeypatch.setattr(fused, "filter_backward", spy)
    rng = np.random.default_rng(90 + T + per_step)
    y, kw = random_problem(rng, T, C=3, batch=(2,), per_step=per_step, times=per_step, missing=0.15)
    grads = _gradients_of_fields(y, kw, {k: torch.tensor(rng.normal(size=(2, T, 3))) for k in fields},
                                 stretch=stretch)
    assert seen == [COTANGENT_PATTERNS[fields]]
    _assert_gradients_equal(grads["torch"], grads["triton"])


@pytest.mark.parametrize("field", ["logliks", "mean", "var"])
def test_filter_loss_on_one_field_gradients_equal_torch_autograd(field, stretches, poisoned):
    """Through ``ks.filter``: a plain sum of one field (a broadcast cotangent for ``mean``)."""
    rng = np.random.default_rng(95)
    y, kw = random_problem(rng, 63, C=3, batch=(2,), per_step=True, times=True, missing=0.15)
    grads = {}
    for backend in ("torch", "triton"):
        t = problem_tensors(kw, grad=True)
        y_t = torch.tensor(y, requires_grad=True)
        post = ks.filter(y_t, backend=backend, **t)
        grads[backend] = torch.autograd.grad(getattr(post, field).sum(), [y_t] + [t[k] for k in NAMES],
                                             allow_unused=True)
    _assert_gradients_equal(grads["torch"], grads["triton"])


def _saved_forward(y, kw, stretch=None):
    """``(views, init, mu, lam)``: what :func:`fused.filter_backward` takes for the problem
    ``(y, kw)``, the forward's saved state from :func:`fused.filter_forward`."""
    views, init = forward_views(y, kw)
    out = fused.filter_forward(views, init, stretch=stretch)
    return views, init, out["mu"], out["lam"]


def _backward_problem(T=23, C=3, stretch=4):
    """``(views, init, mu, lam, cot)`` of a per-step problem for :func:`fused.filter_backward`."""
    rng = np.random.default_rng(97)
    y, kw = random_problem(rng, T, C=C, batch=(), per_step=True, times=True, missing=0.15)
    return (*_saved_forward(y, kw, stretch), torch.tensor(rng.normal(size=(4, 1, T, C))))


def test_backward_without_cotangents_is_zero(poisoned):
    views, init, mu, lam, _ = _backward_problem()
    for g in fused.filter_backward(views, init, mu, lam, (None,) * 4, stretch=4):
        assert torch.all(g == 0)


def test_backward_absent_cotangent_equals_zero_cotangent(poisoned):
    """``None`` gives the gradients of a zero cotangent; a ``(4, B, T, C)`` stack is four cotangents."""
    views, init, mu, lam, cot = _backward_problem()
    cot[1:3] = 0.0
    got = fused.filter_backward(views, init, mu, lam, (cot[0], None, None, cot[3]), stretch=4)
    want = fused.filter_backward(views, init, mu, lam, cot, stretch=4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# Cotangent patterns of the tile backward's tests: a loss on the mean only, on the
# log-likelihoods only (pred_mu and pred_var), and on every centred output.
TILE_BWD_FIELDS = [("mean",), ("logliks",), ("mean", "var", "logliks", "pred_mean", "pred_var")]


@pytest.fixture(params=[4, 8])
def tile_bwd(request, tiles, monkeypatch):
    """The time-parallel backward (``TILE_BWD``) on the :func:`tiles` of 16 steps, rows of 4 and 8
    steps; yields the counted launches of its apply kernel."""
    monkeypatch.setattr(fused, "TILE_BWD", True)
    monkeypatch.setattr(fused, "TILE_ROW", request.param)
    launches = Launches(fused.filter_tile_bwd_kernel)
    monkeypatch.setattr(fused, "filter_tile_bwd_kernel", launches)
    return launches


# Every length with every parameter layout, and each with every cotangent pattern (a Latin square:
# the full product of 72 problems took three minutes under the interpreter).
TILE_BWD_CASES = [(T, per_step, times, TILE_BWD_FIELDS[(i + j) % 3])
                  for i, T in enumerate((16, 37, 131, 201))
                  for j, (per_step, times) in enumerate(((False, False), (True, True), (True, False)))]


@pytest.mark.parametrize("T,per_step,times,fields", TILE_BWD_CASES)
def test_tile_backward_gradients_equal_torch_autograd(T, per_step, times, fields, tile_bwd, poisoned):
    """Gradients of ``y`` and every parameter through the tile backward: one tile (T = 16) up to 4
    stretches of 4 tiles (201), T no multiple of the row, missing values, static and per-step
    parameters, irregular times; a loss on some outputs only leaves the others' cotangents absent."""
    assert fused.uses_tiles(T, 1)
    rng = np.random.default_rng(1000 + T + 10 * per_step + times)
    y, kw = random_problem(rng, T, C=1, batch=(2,), per_step=per_step, times=times, missing=0.15)
    grads = _gradients_of_fields(y, kw, {k: torch.tensor(rng.normal(size=(2, T, 1))) for k in fields})
    assert tile_bwd.count == 1
    _assert_gradients_equal(grads["torch"], grads["triton"])


@pytest.mark.parametrize("present", [(True, False, False, False), (False, False, True, True), (True,) * 4])
@pytest.mark.parametrize("T,per_step,wide", [(37, False, False), (131, True, False), (201, False, False),
                                             (131, True, True)])
def test_tile_backward_equals_walk_backward(T, per_step, wide, present, tile_bwd, poisoned, monkeypatch):
    """:func:`fused.filter_backward` on tiles and on the walks (``TILE_BWD`` off) agree to float64
    rounding, per-step and summed adjoints and the initial state's alike; ``wide`` forces the
    64-bit offsets on both."""
    if wide:
        monkeypatch.setattr(fused, "WIDE_FROM", 0)
    rng = np.random.default_rng(1100 + T)
    y, kw = random_problem(rng, T, C=1, batch=(2,), per_step=per_step, times=per_step, missing=0.15)
    views, init, mu, lam = _saved_forward(y, kw)
    cot = [torch.tensor(rng.normal(size=(2, T, 1))) if on else None for on in present]
    got = fused.filter_backward(views, init, mu, lam, cot)
    monkeypatch.setattr(fused, "TILE_BWD", False)
    want = fused.filter_backward(views, init, mu, lam, cot)
    assert tile_bwd.count == 1
    for a, b in zip(want, got):
        assert a.shape == b.shape and torch.all(torch.isfinite(b))
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
