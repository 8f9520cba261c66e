"""The noise = 0 ablation (the gated-linear-attention limit of KLA) in float32, at lengths where the
exact precision is far beyond float32's range and float64's.

With ``noise = 0`` and ``lam_0 = 1, eta_0 = 0`` the recursion of docs/math.md has a closed form:
``lam_t = decay^(-2t) Lam_t`` and ``eta_t = decay^(-t) E_t`` with

    Lam_t = 1 + sum_{j <= t} decay^(2j) phi_j,      E_t = sum_{j <= t} decay^j b_j,

so ``mu_t = decay^t E_t / Lam_t`` and ``var_t = decay^(2t) / Lam_t`` (tokens counted from 1,
``phi = lam_v k^2``, ``b = lam_v v k``). ``Lam`` is a sum of positive terms, bounded; nothing in it
overflows, and where ``decay^t`` underflows to 0 the exact value is below float64's smallest number.
That is the float64 oracle here at every length, checked against the token-by-token precision
recursion (:func:`kalmanscan.ops.kla.reference.kla_scan_sequential`) where the latter is in range.
Fast decays (0.4 to 0.6) make the exact precision leave float32's range within about 50 tokens
and float64's within about 400.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import device_of, max_rel_error

from kalmanscan.nn import SequenceModel
from kalmanscan.ops.kla import kla_scan
from kalmanscan.ops.kla.reference import kla_scan_sequential

TOL = 2e-5          # the float32 tolerance of every KLA scan test (tests/ops/kla/test_kla_scan.py)


def noiseless_inputs(B, L, M, S, seed=0):
    """Random float64 inputs (unit-norm k and q), decays spread over [0.4, 0.6], noise 0."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return [randn(B, L, M), 0.1 + 2.0 * rand(B, L, M),
            torch.nn.functional.normalize(randn(B, L, S), dim=-1),
            torch.nn.functional.normalize(randn(B, L, S), dim=-1),
            torch.linspace(0.4, 0.6, M * S, dtype=torch.float64).reshape(M, S),
            torch.zeros(M, S, dtype=torch.float64)]


def closed_form(v, lam_v, k, q, decay):
    """``(y, y_var)`` of the noise-free filters from the closed form above, float64."""
    L = v.shape[1]
    power = decay ** torch.arange(1, L + 1, dtype=torch.float64)[:, None, None]      # (L, M, S)
    kk = k.unsqueeze(-2)
    phi = lam_v.unsqueeze(-1) * kk * kk
    b = (lam_v * v).unsqueeze(-1) * kk
    lam_scaled = 1.0 + torch.cumsum(power * power * phi, 1)
    mu = power * torch.cumsum(power * b, 1) / lam_scaled
    var = power * power / lam_scaled
    qq = q.unsqueeze(-2)
    return (qq * mu).sum(-1), (qq * qq * var).sum(-1)


def outputs_and_grads(fn, xs, n_grad):
    """Outputs of ``fn(xs)`` and the gradients of a fixed random functional of them with respect
    to the first ``n_grad`` inputs."""
    xs = [x.detach().clone().requires_grad_(i < n_grad) for i, x in enumerate(xs)]
    out = fn(xs)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum() for o in out)
    return [o.detach() for o in out], list(torch.autograd.grad(loss, xs[:n_grad]))


def test_closed_form_equals_the_reference_recursion():
    """Where the float64 precision recursion is in range (300 tokens: lam up to 0.4^-600 = 1e239)
    the closed form gives its outputs and gradients (v, lam_v, k, q, decay)."""
    xs = noiseless_inputs(2, 300, 3, 4, seed=3)
    ref, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a)[:2], xs, 5)
    out, grads = outputs_and_grads(lambda a: closed_form(*a[:5]), xs, 5)
    for got, want in zip(out + grads, ref + ref_grads):
        assert max_rel_error(got, want) < 1e-10


@pytest.mark.parametrize("L,backend", [(1, "torch"), (63, "recurrent"), (63, "triton"), (1000, "recurrent"),
                                       (1000, "triton"), (4096, "torch")])
def test_float32_matches_the_oracle_at_every_length(L, backend):
    """float32, noise = 0, decays 0.4-0.6, up to 4096 tokens: outputs and the gradients of all
    inputs finite; outputs and the gradients of v, lam_v, k, q, decay within TOL of the float64
    oracle, and the noise gradient (which the closed form does not give) within TOL of the float64
    parallel scan (see :func:`test_noise_gradient_of_both_formulations_agree`); measured at most
    2.2e-7 (outputs and those five gradients) and 4.3e-7 (noise) at L = 1000 and 4096. The triton
    backend hands these filters to the torch one (their precision is beyond its kernels' range)."""
    xs = noiseless_inputs(2, L, 3, 4, seed=L)
    ref, ref_grads = outputs_and_grads(lambda a: closed_form(*a[:5]), xs, 5)
    out, grads = outputs_and_grads(lambda a: kla_scan(*a, backend=backend),
                                   [x.float().to(device_of(backend)) for x in xs], 6)
    for got in out + grads:
        assert torch.isfinite(got).all()
    for i, (got, want) in enumerate(zip(out + grads[:5], ref + ref_grads)):
        assert max_rel_error(got, want) < TOL, i
    noise_grad = outputs_and_grads(lambda a: kla_scan(*a, backend="torch"), xs, 6)[1][5]
    assert max_rel_error(grads[5], noise_grad) < TOL


def test_noise_gradient_of_both_formulations_agree():
    """At noise = 0 the gradient with respect to the noise, in float64 at 1000 tokens, is the same
    from the parallel scan (Möbius products read out as the variance, affine scan of the mean) and
    from the token-by-token mean-form recursion: two formulations, one answer (finite differences
    of the precision recursion check it at 120 tokens, tests/ops/kla/test_kla_scan.py)."""
    xs = noiseless_inputs(2, 1000, 3, 4, seed=5)
    grads = [outputs_and_grads(lambda a: kla_scan(*a, backend=b), xs, 6)[1][5] for b in ("torch", "recurrent")]
    assert torch.isfinite(grads[0]).all() and grads[0].abs().max() > 0
    assert max_rel_error(grads[1], grads[0]) < 1e-12


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_noise_zero_model_trains_in_float32(backend):
    """The harness's --noise-zero model (sigma fixed at 0 in every KLA layer, the layer's own
    initial decays down to 0.2) trains in float32 on a CPU at L = 128, past float32's range of the
    exact precision (about 30 tokens at decay 0.2): finite loss and gradients at every step, and
    the loss goes down (on the triton backend's device)."""
    zero_kla_noise = importlib.import_module("evidence.train").zero_kla_noise
    torch.manual_seed(0)
    model = SequenceModel(16, 8, 2, mixer="kla", d_state=16, backend=backend, init="kalmanscan",
                          weight_init="torch").to(device_of(backend))
    assert zero_kla_noise(model) == 2
    decay, noise = model.blocks[0].mixer.discretized()
    assert (noise == 0).all() and decay.min() < 0.3
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (2, 129), generator=g)
    tokens[:, 1::2] = tokens[:, 0:-1:2]          # every other token repeats the one before it
    tokens = tokens.to(device_of(backend))
    losses = []
    for _ in range(6):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
