"""The mLSTM mixer: chunkwise recurrence against the sequential one, the stabiliser, gradients,
the model around it, bad arguments (prefill and decoding of the layer: tests/test_model.py)."""

import pytest
import torch
import torch.nn.functional as F

from kalmanscan.nn import MIXERS, SequenceModel
from kalmanscan.nn.baselines.mlstm import MLSTM, mlstm_chunkwise, mlstm_sequential

TOL = dict(rtol=1e-10, atol=1e-10)


def problem(B=2, L=37, H=3, d_k=4, d_v=5, scale=5.0, with_state=True, seed=0):
    """Random q, k, v, gate pre-activations of size ``scale``, and an initial ``(C, n, m)``."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = randn(B, L, H, d_k), randn(B, L, H, d_k), randn(B, L, H, d_v)
    i_pre, log_f = scale * randn(B, L, H), F.logsigmoid(scale * randn(B, L, H))
    state = (randn(B, H, d_v, d_k), randn(B, H, d_k), randn(B, H)) if with_state else None
    return (q, k, v, i_pre, log_f), state


@pytest.mark.parametrize("L", [1, 37, 130])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunkwise_equals_sequential(L, chunk, with_state):
    args, state = problem(L=L, with_state=with_state)
    h_ref, s_ref = mlstm_sequential(*args, state)
    h, s = mlstm_chunkwise(*args, state, chunk=chunk)
    assert h.shape == (2, L, 3, 5) and torch.isfinite(h).all()
    torch.testing.assert_close(h, h_ref, **TOL)
    for a, b in zip(s, s_ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL)


def test_output_is_invariant_to_the_stabiliser():
    """A state (C, n, m) stands for (exp(m) C, exp(m) n): shifting m by s and scaling C, n by
    exp(-s) changes nothing."""
    args, (C, n, m) = problem(L=20)
    h, _ = mlstm_chunkwise(*args, (C, n, m), chunk=8)
    s = 3.0 * torch.randn(m.shape, dtype=torch.float64)
    shifted = (C * torch.exp(-s)[..., None, None], n * torch.exp(-s)[..., None], m + s)
    torch.testing.assert_close(mlstm_chunkwise(*args, shifted, chunk=8)[0], h, **TOL)
    torch.testing.assert_close(mlstm_sequential(*args, shifted)[0], h, **TOL)


def test_chunkwise_carries_its_state_across_calls():
    args, state = problem(L=50)
    h, s = mlstm_chunkwise(*args, state, chunk=16)
    h1, s1 = mlstm_chunkwise(*(t[:, :23] for t in args), state, chunk=16)
    h2, s2 = mlstm_chunkwise(*(t[:, 23:] for t in args), s1, chunk=16)
    torch.testing.assert_close(torch.cat([h1, h2], 1), h, **TOL)
    for a, b in zip(s2, s):
        torch.testing.assert_close(a, b, **TOL)


def test_extreme_gates_stay_finite():
    args, state = problem(L=70, scale=40.0)
    h, s = mlstm_chunkwise(*args, state, chunk=16)
    assert torch.isfinite(h).all() and all(torch.isfinite(t).all() for t in s)
    torch.testing.assert_close(h, mlstm_sequential(*args, state)[0], **TOL)


@pytest.mark.parametrize("form", ["chunkwise", "sequential"])
def test_recurrence_gradcheck(form):
    args, state = problem(B=1, L=5, H=2, d_k=2, d_v=2, scale=2.0, seed=3)
    inputs = tuple(t.clone().requires_grad_() for t in args + state)

    def run(q, k, v, i_pre, log_f, C, n, m):
        if form == "chunkwise":
            h, s = mlstm_chunkwise(q, k, v, i_pre, log_f, (C, n, m), chunk=2)
        else:
            h, s = mlstm_sequential(q, k, v, i_pre, log_f, (C, n, m))
        return h, s[0] * torch.exp(s[2])[..., None, None], s[1] * torch.exp(s[2])[..., None]

    assert torch.autograd.gradcheck(run, inputs)


def layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    m = MLSTM(8, n_heads=2, **kwargs).double()
    with torch.no_grad():
        m.gate_proj.weight.normal_(0.0, 1.0)    # input-dependent gates (they start constant)
    return m


def series(B=2, L=37, D=8, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, L, D, dtype=torch.float64)


def test_registered():                          # the registry names the baseline
    assert MIXERS["mlstm"] is MLSTM


def test_layer_is_causal():
    m = layer()
    x = series(L=12)
    x2 = x.clone()
    x2[:, 7:] = torch.randn_like(x2[:, 7:])
    torch.testing.assert_close(m(x)[:, :7], m(x2)[:, :7], **TOL)


def test_recurrence_runs_in_float32_under_bf16_autocast():
    torch.manual_seed(0)
    m = MLSTM(8, n_heads=2)
    x = torch.randn(2, 20, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = m(x, state=m.init_state(2))
    assert torch.isfinite(y).all()
    assert state.C.dtype == state.n.dtype == state.m.dtype == torch.float32


def test_sequence_model_trains():
    torch.manual_seed(0)
    model = SequenceModel(11, 32, 2, mixer="mlstm", n_heads=4)
    assert isinstance(model.blocks[0].mixer, MLSTM) and model.blocks[0].mixer.d_inner == 64
    tokens = torch.randint(0, 11, (2, 70))
    logits = model(tokens)
    assert logits.shape == (2, 70, 11)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("kwargs,name", [
    (dict(n_heads=0), "n_heads"),
    (dict(n_heads=3), "n_heads"),
    (dict(n_heads=2.0), "n_heads"),
    (dict(d_conv=0), "d_conv"),
    (dict(chunk_size=-1), "chunk_size"),
    (dict(expand=1.3), "expand"),
])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MLSTM(8, **kwargs)


def test_bad_d_model_and_state():
    with pytest.raises(ValueError, match="d_model"):
        MLSTM(0)
    m = MLSTM(8, n_heads=2)
    with pytest.raises(ValueError, match="state"):
        m(torch.randn(3, 4, 8), state=m.init_state(2))
    with pytest.raises(ValueError, match="chunk"):
        mlstm_chunkwise(*problem(L=4)[0], chunk=0)
