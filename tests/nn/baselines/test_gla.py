"""The "gla" mixer's torch form: the chunked recurrence against the sequential one, and its state
checks (prefill and decoding of the layer: tests/nn/test_model.py; fla on a GPU: test_gla_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

from kalmanscan.nn.baselines.gla import GatedLinearAttention, GLAState, gla_chunked

TOL = dict(rtol=1e-10, atol=1e-12)


def gla_sequential(q, k, v, g, scale, state):
    outs = []
    for t in range(q.shape[1]):
        state = g[:, t].exp()[..., None] * state + k[:, t, ..., None] * v[:, t, :, None, :]
        outs.append(scale * (q[:, t, ..., None] * state).sum(-2))
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("L,chunk", [(1, 16), (16, 16), (37, 16), (37, 8)])
def test_gla_chunked_equals_recurrence(L, chunk):
    torch.manual_seed(0)
    B, H, K, V = 2, 3, 4, 5
    q, k = torch.randn(2, B, L, H, K, dtype=torch.float64)
    v = torch.randn(B, L, H, V, dtype=torch.float64)
    g = F.logsigmoid(3 * torch.randn(B, L, H, K, dtype=torch.float64))
    s0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o, s = gla_chunked(q, k, v, g, 0.5, s0, chunk=chunk)
    o_ref, s_ref = gla_sequential(q, k, v, g, 0.5, s0)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


def test_gla_rejects_a_state_of_the_wrong_shape():
    layer = GatedLinearAttention(16, n_heads=2)
    x = torch.randn(3, 5, 16)
    good = layer.init_state(3)
    assert layer(x, good)[1].S.shape == good.S.shape
    for bad in (good.S, GLAState(good.conv, torch.zeros(3, 2, 8, 16)),
                GLAState(good.conv, torch.zeros(2, 2, 4, 16))):
        with pytest.raises(ValueError, match="state"):
            layer(x, bad)
        with pytest.raises(ValueError, match="state"):
            layer.step(x[:, 0], bad)
