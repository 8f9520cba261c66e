"""The stretch summaries ks.distributed exchanges (kalmanscan.model.merged): in chunks and in pieces, and
the incoming states composed from them (kalmanscan.distributed.summaries).

A summary is projective (its 7 numbers are defined up to a common positive scale), so summaries are
compared by their action on a state, ``lam = (A lam0 + B) / (C lam0 + D)``, ``eta = (E lam0 + F +
G eta0) / (C lam0 + D)``, against the float64 token-by-token recursion.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import max_rel_error, problem_tensors, random_problem

from kalmanscan.model import merged
from kalmanscan.distributed import summaries
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter import torch as filter_torch
from kalmanscan.ops.kla import torch as kla_torch
from kalmanscan.ops.kla.triton import backend as kla_triton
from kalmanscan.ops.kla.reference import kla_scan_sequential

TOL = 1e-12      # float64 against float64
F32_TOL = 2e-5   # the float32 piece-map kernel against float64 (tests/ops/kla/test_kla_scan.py's bound)


def kla_problem(B, L, M, S, seed):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    unit = lambda: torch.nn.functional.normalize(torch.randn(B, L, S, **f64), dim=-1)  # noqa: E731
    return [torch.randn(B, L, M, **f64), 0.1 + 2.0 * torch.rand(B, L, M, **f64), unit(), unit(),
            0.6 + 0.4 * torch.rand(M, S, **f64), 0.05 + 0.95 * torch.rand(M, S, **f64)]


def act(P, lam0, eta0):
    """The state ``(lam, eta)`` after the summary ``P`` from ``(lam0, eta0)``."""
    A, B, C, D, E, F, G = (x.double() for x in P)
    den = C * lam0 + D
    return (A * lam0 + B) / den, (E * lam0 + F + G * eta0) / den


def start(shape, seed):
    f64 = dict(generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return 0.5 + torch.rand(shape, **f64), torch.randn(shape, **f64)


@pytest.mark.parametrize("chunk_elements", [36, 1])
def test_kla_summary_in_chunks_acts_as_the_recursion(chunk_elements):
    """B M S = 12 filters: chunks of 3 tokens (the last of 2, at L = 23) and of 1 (fewer elements
    than filters); values and gradients through the chunks recomputed in the backward."""
    xs = [x.requires_grad_() for x in kla_problem(2, 23, 3, 2, seed=1)]
    lam0, eta0 = start((2, 3, 2), seed=2)
    w = torch.randn(2, 2, 3, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lam, eta = act(kla_torch.summary(*xs, torch.float64, chunk_elements=chunk_elements), lam0, eta0)
    used = xs[:3] + xs[4:]                          # a summary does not read q
    grads = torch.autograd.grad((w[0] * lam + w[1] * eta).sum(), used)
    ref = kla_scan_sequential(*xs, lam0, eta0)[2:]
    ref_grads = torch.autograd.grad((w[0] * ref[0] + w[1] * ref[1]).sum(), used)
    for a, r in zip((lam, eta, *grads), (*ref, *ref_grads)):
        assert max_rel_error(a, r) < TOL


def test_filter_summary_in_chunks_equals_one_chunk():
    """The filter's summary (no transition at step 0: only chunk 0's first step) in chunks of
    2 steps of its 6 series-channels equals the one-chunk product, values and gradients."""
    y, kw = random_problem(np.random.default_rng(5), 13, C=3, batch=(2,), per_step=True)
    tensors = problem_tensors(kw, grad=True)
    params = [tensors[k] for k in ("theta", "sigma", "obs_var", "mean", "h")]
    lam0, eta0 = start((2, 1, 3), seed=6)
    w = torch.randn(2, 2, 1, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def run(chunk_elements):
        p = prepare(torch.tensor(y), **tensors)
        lam, eta = act(filter_torch.summary(p, chunk_elements=chunk_elements), lam0, eta0)
        return lam, eta, *torch.autograd.grad((w[0] * lam + w[1] * eta).sum(), params)

    for a, r in zip(run(12), run(merged.CHUNK_ELEMENTS)):
        assert max_rel_error(a, r) < TOL


@pytest.mark.parametrize("L", [65, 129])
def test_triton_summary_in_pieces_acts_as_the_recursion(L):
    """The piece-map kernel cuts ``L`` into pieces of at least 64 tokens (its MIN_PIECE): 2 of
    33 and 32 at 65, 3 of 43 at 129 (composed by a tree); float32 against float64."""
    xs = kla_problem(1, L, 5, 3, seed=L)
    lam0, eta0 = start((1, 5, 3), seed=7)
    lam, eta = act(kla_triton.summary(*(x.float() for x in xs), torch.float64), lam0, eta0)
    ref = kla_scan_sequential(*xs, lam0, eta0)[2:]
    assert max_rel_error(lam, ref[0]) < F32_TOL
    assert max_rel_error(eta, ref[1]) < F32_TOL


@pytest.mark.parametrize("world", [2, 5])
def test_incoming_states_are_the_states_at_the_cuts(world):
    """Stretches of 1 to 6 tokens; rank 0 sends ``P_0 K``; every rank's incoming ``(lam, eta)``
    and ``(var, mu)`` equal the recursion's state before its first token."""
    lengths = [1, 6, 2, 5, 3][:world]
    cuts = torch.tensor([0] + lengths).cumsum(0).tolist()
    xs = kla_problem(2, cuts[-1], 3, 2, seed=8 + world)
    lam0, eta0 = start((2, 3, 2), seed=9)
    local = []
    for r in range(world):
        P = kla_torch.summary(*(x[:, cuts[r]:cuts[r + 1]] for x in xs[:4]), *xs[4:], torch.float64)
        local.append(torch.stack(merged.compose(merged.initial(lam0, eta0), P) if r == 0 else P))
    gathered = torch.stack(local)
    for r in range(1, world):
        ref_lam, ref_eta = kla_scan_sequential(*(x[:, :cuts[r]] for x in xs[:4]), *xs[4:], lam0, eta0)[2:]
        lam, eta = summaries.incoming(gathered, r)
        var, mu = summaries.incoming_moments(gathered, r)
        for a, ref in ((lam, ref_lam), (eta, ref_eta), (var, 1 / ref_lam), (mu, ref_eta / ref_lam)):
            assert max_rel_error(a, ref) < TOL, r
