"""Gated DeltaNet: chunked recurrence against the sequential one, the layer's prefill and decoding,
gradients, the model around it, and bad arguments (prefill and decoding of the layer: tests/test_model.py)."""

import pytest
import torch
import torch.nn.functional as F

from kalmanscan.nn import MIXERS, SequenceModel
from kalmanscan.nn.baselines.gdn import GatedDeltaNet, GDNState, gated_delta_rule_chunked, gated_delta_rule_sequential

TOL = dict(rtol=1e-10, atol=1e-10)


def problem(B=2, L=37, H=3, K=4, V=5, seed=0, requires_grad=False):
    """Random q, k (unit norm), v, g <= 0, beta in (0, 1) and a non-zero initial state, float64."""
    torch.manual_seed(seed)
    q, k = F.normalize(torch.randn(2, B, L, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(B, L, H, V, dtype=torch.float64)
    g = -F.softplus(2 * torch.randn(B, L, H, dtype=torch.float64))
    beta = torch.rand(B, L, H, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, dtype=torch.float64)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta, S0)]


def layer(d_model=8, seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = dict(n_heads=2, chunk_size=8, **kwargs)
    return GatedDeltaNet(d_model, **kwargs).double()


def series(B=2, L=37, D=8, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, L, D, dtype=torch.float64)


@pytest.mark.parametrize("L,chunk", [(1, 64), (37, 64), (130, 64), (37, 8), (64, 16)])
def test_chunked_equals_sequential(L, chunk):
    q, k, v, g, beta, S0 = problem(L=L)
    o, S = gated_delta_rule_chunked(q, k, v, g, beta, 0.5, S0, chunk=chunk)
    o_ref, S_ref = gated_delta_rule_sequential(q, k, v, g, beta, 0.5, S0)
    assert o.shape == (2, L, 3, 5) and S.shape == S0.shape
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


def test_sequential_is_the_delta_rule():
    """One step by hand: S_1 = alpha (I - beta k k^T) S_0 + beta k v^T, o_1 = scale S_1^T q."""
    q, k, v, g, beta, S0 = problem(B=1, L=1, H=1)
    alpha, b, kk = g[0, 0, 0].exp(), beta[0, 0, 0], k[0, 0, 0]
    S1 = alpha * (torch.eye(4, dtype=torch.float64) - b * torch.outer(kk, kk)) @ S0[0, 0] \
        + b * torch.outer(kk, v[0, 0, 0])
    o, S = gated_delta_rule_sequential(q, k, v, g, beta, 0.5, S0)
    torch.testing.assert_close(S[0, 0], S1, **TOL)
    torch.testing.assert_close(o[0, 0, 0], 0.5 * S1.T @ q[0, 0, 0], **TOL)


def test_chunked_float32_stays_close_at_length_512():
    q, k, v, g, beta, S0 = problem(B=1, L=512, H=2, K=8, V=8)
    o_ref, S_ref = gated_delta_rule_sequential(q, k, v, g, beta, 0.5, S0)
    q, k, v, g, beta, S0 = (t.float() for t in (q, k, v, g, beta, S0))
    o, S = gated_delta_rule_chunked(q, k, v, g, beta, 0.5, S0, chunk=64)
    assert o.dtype == torch.float32 and torch.isfinite(o).all()
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-4, atol=1e-4)


def test_gradcheck_of_the_chunked_recurrence():
    inputs = problem(B=1, L=7, H=1, K=3, V=2, requires_grad=True)

    def f(q, k, v, g, beta, S0):
        return gated_delta_rule_chunked(q, k, v, g, beta, 0.7, S0, chunk=3)

    assert torch.autograd.gradcheck(f, inputs)


def test_layer_is_causal():
    m = layer()
    x = series(L=20)
    x2 = x.clone()
    x2[:, 11:] = torch.randn_like(x2[:, 11:])
    torch.testing.assert_close(m(x)[:, :11], m(x2)[:, :11], **TOL)


def test_layer_gates_and_gradients():
    m = layer()
    x = series(L=9)
    q, k, v, g, beta, _ = m.inputs(x, m.init_state(2).conv)
    assert (g < 0).all() and ((beta > 0) & (beta < 1)).all()
    torch.testing.assert_close(q.norm(dim=-1), torch.ones_like(q[..., 0]), **TOL)
    m(x).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_layer_keeps_the_recurrence_in_float32_under_bf16():
    torch.manual_seed(0)
    m = GatedDeltaNet(16, n_heads=2, dtype=torch.bfloat16)
    y, state = m(torch.randn(2, 70, 16, dtype=torch.bfloat16), state=m.init_state(2))
    assert y.dtype == torch.bfloat16 and state.S.dtype == torch.float32
    assert torch.isfinite(y.float()).all()
    m32 = GatedDeltaNet(16, n_heads=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y32, state = m32(torch.randn(2, 70, 16), state=m32.init_state(2))
    assert state.S.dtype == torch.float32 and torch.isfinite(y32.float()).all()


def test_sequence_model_trains_a_step():
    torch.manual_seed(0)
    assert MIXERS["gdn"] is GatedDeltaNet
    model = SequenceModel(11, 32, 2, mixer="gdn")
    assert all(isinstance(b.mixer, GatedDeltaNet) for b in model.blocks)
    assert model.blocks[0].mixer.d_value == 16
    tokens = torch.randint(0, 11, (2, 70))
    logits = model(tokens[:, :-1])
    assert logits.shape == (2, 69, 11)
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_heads=0), "n_heads"),
    (dict(n_heads=3), "n_heads"),
    (dict(n_heads=2.0), "n_heads"),
    (dict(d_conv=0), "d_conv"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(expand=1.3), "expand"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatedDeltaNet(8, **kwargs)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="d_model"):
        GatedDeltaNet(0)
    with pytest.raises(ValueError, match="chunk"):
        gated_delta_rule_chunked(*problem(L=3)[:5], 1.0, problem(L=3)[5], chunk=0)
    m = layer()
    with pytest.raises(ValueError, match="x"):
        m(torch.zeros(2, 5, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="state"):
        m(series(), state=GDNState(m.init_state(2).conv, torch.zeros(2, 2, 4, 4)))
    with pytest.raises(ValueError, match="x_t"):
        m.step(series()[:, :, 0], m.init_state(2))
