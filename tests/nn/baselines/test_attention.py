"""The attention baseline's rotary positions: the angle table as an operator (opcheck), the rotation
against its closed form, and a compiled model equal to eager."""

from __future__ import annotations

import math

import pytest
import torch

from kalmanscan.nn.baselines.attention import CausalAttention, rotary, rotary_table


def test_rotary_table_is_a_checked_operator():
    torch.library.opcheck(rotary_table, (3, 17, 8, 1e4, torch.device("cpu"), torch.float32))
    cos, sin = rotary_table(3, 17, 8, 1e4, torch.device("cpu"), torch.bfloat16)
    assert cos.shape == sin.shape == (17, 4) and cos.dtype == torch.bfloat16


def test_rotary_rotates_each_pair_by_its_angle():
    """Pair ``(x[j], x[j + d/2])`` at position ``p`` turns by ``p base^(-2j/d)``, and every
    token's norm is kept."""
    x = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    out = rotary(x, 5, 100.0)
    d, p, j = 8, 5 + 7, 2
    angle = p * 100.0 ** (-2 * j / d)
    x1, x2 = x[0, 1, 7, j].item(), x[0, 1, 7, j + d // 2].item()
    want = (x1 * math.cos(angle) - x2 * math.sin(angle), x2 * math.cos(angle) + x1 * math.sin(angle))
    got = (out[0, 1, 7, j].item(), out[0, 1, 7, j + d // 2].item())
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6    # the angles are float32
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.slow
def test_compiled_attention_equals_eager():
    torch.manual_seed(0)
    layer = CausalAttention(16, 2)
    x = torch.randn(2, 33, 16, requires_grad=True)
    eager = layer(x)
    (grad,) = torch.autograd.grad(eager.square().sum(), x)
    compiled = torch.compile(layer, fullgraph=True)(x)
    (grad_c,) = torch.autograd.grad(compiled.square().sum(), x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_c, grad, rtol=1e-5, atol=1e-6)
