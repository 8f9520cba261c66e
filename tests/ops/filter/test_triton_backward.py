"""The triton backend's backward: cotangents of unused outputs are absent (never read, exact
gradients), and the time-parallel tile backward for few long series (``FilterConfig.tile_bwd``)
against float64 torch autograd and the walk backward. Kernels under TRITON_INTERPRET=1 on the
CPU; small stretches and tiles (explicit configs) make small problems cross many of them, each
lane walking at most ~64 steps.
"""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import KERNEL_DEVICE, NAMES, Launches, config, forward_views, prepared, random_problem

import kalmanscan as ks
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.filter.triton import backend as triton
from kalmanscan.ops.filter.triton import walks

FOURS = config(min_stretch=4, target_lanes=1 << 30)

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


def _gradients_of_fields(y, kw, weights, cfg):
    """``{backend: gradients}`` of ``y`` and :data:`NAMES` (None where unused) of the loss
    ``sum((out[k] * w).sum() for k, w in weights.items())`` on the filter's result ``out``, on the
    torch backend and on the triton one launched with ``cfg``."""
    grads = {}
    for backend in ("torch", "triton"):
        p, y_t, t = prepared(y, kw, grad=True)
        out = triton.filter(p, cfg) if backend == "triton" else torch_backend.filter(p)
        loss = sum((out[k] * w).sum() for k, w in weights.items())
        grads[backend] = torch.autograd.grad(loss, [y_t] + [t[k] for k in NAMES], allow_unused=True)
    return grads


# Every cotangent pattern on one stretch (T = 37, a walk no multiple of the unroll) and on several
# (13 stretches of 5 steps, the last of 3; 9 forced stretches of 7, the last of 5), static and per
# step in turn.
SHAPES = [(37, config(), False), (63, FOURS, True), (61, config(stretch=7), False), (37, config(), True)]
ABSENT_CASES = [(fields, *SHAPES[(i + k) % 4]) for i, fields in enumerate(COTANGENT_PATTERNS) for k in (0, 1)]


@pytest.mark.parametrize("fields,T,cfg,per_step", ABSENT_CASES,
                         ids=[f"{'+'.join(c[0])}-T{c[1]}-L{triton.plan(2, c[1], 3, c[2])[1]}-step{int(c[3])}"
                              for c in ABSENT_CASES])
def test_absent_cotangents_gradients_equal_torch_autograd(fields, T, cfg, per_step, poisoned, monkeypatch):
    """A loss on some outputs only: the backward gets the others' cotangents as None, reads none of
    them (one stretch, and several), and the gradients stay exact."""
    seen = []
    backward = walks.filter_backward

    def spy(views, init, mu, lam, cot, config):
        seen.append(tuple(g is not None for g in cot))
        return backward(views, init, mu, lam, cot, config)

    monkeypatch.setattr(walks, "filter_backward", spy)
    rng = np.random.default_rng(90 + T + per_step)
    y, kw = random_problem(rng, T, C=3, batch=(2,), per_step=per_step, times=per_step, missing=0.15)
    weights = {k: torch.tensor(rng.normal(size=(2, T, 3)), device=KERNEL_DEVICE) for k in fields}
    grads = _gradients_of_fields(y, kw, weights, cfg)
    assert seen == [COTANGENT_PATTERNS[fields]]
    _assert_gradients_equal(grads["torch"], grads["triton"])


@pytest.mark.parametrize("field", ["logliks", "mean", "var"])
def test_filter_loss_on_one_field_gradients_equal_torch_autograd(field, poisoned):
    """Through ``ks.filter`` (the default launch: one stretch): a plain sum of one field (a
    broadcast cotangent for ``mean``)."""
    rng = np.random.default_rng(95)
    y, kw = random_problem(rng, 23, C=3, batch=(2,), per_step=True, times=True, missing=0.15)
    grads = {}
    for backend in ("torch", "triton"):
        _, y_t, t = prepared(y, kw, grad=True)
        post = ks.filter(y_t, backend=backend, **t)
        grads[backend] = torch.autograd.grad(getattr(post, field).sum(), [y_t] + [t[k] for k in NAMES],
                                             allow_unused=True)
    _assert_gradients_equal(grads["torch"], grads["triton"])


def _saved_forward(y, kw, cfg):
    """``(views, init, mu, lam)``: what :func:`triton.filter_backward` takes for the problem
    ``(y, kw)``, the forward's saved state from :func:`triton.filter_forward`, on
    :data:`KERNEL_DEVICE` (the views made there, so broadcast parameters keep their zero strides)."""
    views = triton.kernel_views(prepared(y, kw)[0])
    init = forward_views(y, kw)[1].to(KERNEL_DEVICE)
    out = triton.filter_forward(views, init, config=cfg)
    return views, init, out["mu"], out["lam"]


STRETCH4 = config(stretch=4)


def _backward_problem(T=23, C=3):
    """``(views, init, mu, lam, cot)`` of a per-step problem for :func:`triton.filter_backward`
    on stretches of 4 steps."""
    rng = np.random.default_rng(97)
    y, kw = random_problem(rng, T, C=C, batch=(), per_step=True, times=True, missing=0.15)
    return (*_saved_forward(y, kw, STRETCH4), torch.tensor(rng.normal(size=(4, 1, T, C)), device=KERNEL_DEVICE))


def test_backward_without_cotangents_is_zero(poisoned):
    views, init, mu, lam, _ = _backward_problem()
    for g in triton.filter_backward(views, init, mu, lam, (None,) * 4, STRETCH4):
        assert torch.all(g == 0)


def test_backward_absent_cotangent_equals_zero_cotangent(poisoned):
    """``None`` gives the gradients of a zero cotangent; a ``(4, B, T, C)`` stack is four cotangents."""
    views, init, mu, lam, cot = _backward_problem()
    cot[1:3] = 0.0
    got = triton.filter_backward(views, init, mu, lam, (cot[0], None, None, cot[3]), STRETCH4)
    want = triton.filter_backward(views, init, mu, lam, cot, STRETCH4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# Cotangent patterns of the tile backward's tests: a loss on the mean only, on the
# log-likelihoods only (pred_mu and pred_var), and on every centred output.
TILE_BWD_FIELDS = [("mean",), ("logliks",), ("mean", "var", "logliks", "pred_mean", "pred_var")]


@pytest.fixture
def tile_launches(monkeypatch):
    """The counted launches of the tile backward's apply kernel."""
    launches = Launches(walks.filter_tile_bwd_kernel)
    monkeypatch.setattr(walks, "filter_tile_bwd_kernel", launches)
    return launches


def _tiles(row):
    """The time-parallel forward and backward on tiles of 16 steps in rows of ``row``, at most 4
    stretches of them; the walks (``tile_bwd`` off) on stretches of about 16 steps."""
    return config(tile=16, tile_stretches=4, tile_row=row, tile_bwd=True, min_stretch=16, target_lanes=1 << 30)


# (T, row, per_step, times, fields): one tile (T = 16); 3 tiles in 3 stretches, the last of 5
# steps (37); 4 tiles in 4 stretches, the last ending mid-row (63); 7 tiles in 4 stretches of 2,
# the last of one tile of 5 steps (101). Every length with every parameter layout; rows of 4 and 8 steps and
# the cotangent patterns in a Latin square over them (the full product of 72 problems took three
# minutes under the interpreter).
TILE_BWD_CASES = [(T, (4, 8)[(i + j) % 2], per_step, times, TILE_BWD_FIELDS[(i + j) % 3])
                  for i, T in enumerate((16, 37, 63, 101))
                  for j, (per_step, times) in enumerate(((False, False), (True, True), (True, False)))]


@pytest.mark.parametrize("T,row,per_step,times,fields", TILE_BWD_CASES,
                         ids=[f"T{c[0]}-row{c[1]}-step{int(c[2])}-times{int(c[3])}-{len(c[4])}fields"
                              for c in TILE_BWD_CASES])
def test_tile_backward_gradients_equal_torch_autograd(T, row, per_step, times, fields, tile_launches, poisoned):
    """Gradients of ``y`` and every parameter through the tile backward: one tile up to 4
    stretches of 2 tiles, T no multiple of the row, missing values, static and per-step
    parameters, irregular times; a loss on some outputs only leaves the others' cotangents absent."""
    cfg = _tiles(row)
    assert triton.uses_tiles(T, 1, cfg)
    rng = np.random.default_rng(1000 + T + 10 * per_step + times)
    y, kw = random_problem(rng, T, C=1, batch=(2,), per_step=per_step, times=times, missing=0.15)
    weights = {k: torch.tensor(rng.normal(size=(2, T, 1)), device=KERNEL_DEVICE) for k in fields}
    grads = _gradients_of_fields(y, kw, weights, cfg)
    assert tile_launches.count == 1
    _assert_gradients_equal(grads["torch"], grads["triton"])


# (T, row, per_step, wide, present): every cotangent pattern; static and per-step adjoints; one
# case with 64-bit offsets on both.
TILE_WALK_CASES = [
    (37, 4, False, False, (True, False, False, False)),
    (63, 8, True, False, (False, False, True, True)),
    (131, 2, False, False, (True,) * 4),
    (131, 8, True, True, (True, False, False, False)),
    (63, 4, False, True, (True,) * 4),
    (37, 16, True, False, (False, False, True, True)),
]


@pytest.mark.parametrize("T,row,per_step,wide,present", TILE_WALK_CASES,
                         ids=[f"T{c[0]}-row{c[1]}-step{int(c[2])}-wide{int(c[3])}-{sum(c[4])}cot"
                              for c in TILE_WALK_CASES])
def test_tile_backward_equals_walk_backward(T, row, per_step, wide, present, tile_launches, poisoned):
    """:func:`triton.filter_backward` on tiles and on the walks (``tile_bwd`` off) agree to float64
    rounding, per-step and summed adjoints and the initial state's alike; ``wide`` forces the
    64-bit offsets on both."""
    cfg = _tiles(row)
    if wide:
        cfg = dataclasses.replace(cfg, wide_from=0)
    rng = np.random.default_rng(1100 + T)
    y, kw = random_problem(rng, T, C=1, batch=(2,), per_step=per_step, times=per_step, missing=0.15)
    views, init, mu, lam = _saved_forward(y, kw, cfg)
    cot = [torch.tensor(rng.normal(size=(2, T, 1)), device=KERNEL_DEVICE) if on else None for on in present]
    got = triton.filter_backward(views, init, mu, lam, cot, cfg)
    want = triton.filter_backward(views, init, mu, lam, cot, dataclasses.replace(cfg, tile_bwd=False))
    assert tile_launches.count == 1
    for a, b in zip(want, got):
        assert a.shape == b.shape and torch.all(torch.isfinite(b))
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
