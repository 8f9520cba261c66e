"""Causal softmax attention with rotary positions and a KV cache (the ``"attention"`` mixer)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kalmanscan.nn.common import heads, positive_int

__all__ = ["CausalAttention", "AttentionState", "rotary", "rotary_table"]


class AttentionState(NamedTuple):
    """KV cache: ``k``, ``v`` (B, H, T, d_head) for the T tokens seen so far."""

    k: torch.Tensor
    v: torch.Tensor


@torch.library.custom_op("kalmanscan::rotary_table", mutates_args=())
def rotary_table(offset: int, length: int, dim: int, base: float, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary angles, each ``(length, dim // 2)`` in ``dtype``: position
    ``offset + i`` times ``base^(-2j / dim)``, computed in float32.

    An operator, so that ``torch.compile`` computes the table once a call: traced as plain
    operations, Inductor fuses ``cos`` and ``sin`` into the kernels that rotate ``q`` and ``k``
    and evaluates them for every batch row and head, at angles up to the sequence length in
    radians, where the range reduction is slow (docs/performance.md, "A handicap of the attention
    baseline")."""
    inv_freq = base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    pos = torch.arange(offset, offset + length, device=device, dtype=torch.float32)
    angle = pos[:, None] * inv_freq
    return angle.cos().to(dtype), angle.sin().to(dtype)


@rotary_table.register_fake
def _(offset, length, dim, base, device, dtype):
    shape = (length, dim // 2)
    return torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)


def rotary(x: torch.Tensor, offset: int, base: float) -> torch.Tensor:
    """Rotary position embedding of x (B, H, L, d) at positions ``offset .. offset + L - 1``
    (the angles from :func:`rotary_table`)."""
    d = x.shape[-1]
    cos, sin = rotary_table(offset, x.shape[-2], d, base, x.device, x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class CausalAttention(nn.Module):
    """Multi-head causal softmax attention (``F.scaled_dot_product_attention``) with rotary
    positions; decoding appends to a KV cache (O(T) work per token, as attention needs)."""

    def __init__(self, d_model: int, n_heads: int = 4, rope_base: float = 10000.0,
                 device=None, dtype=None):
        super().__init__()
        positive_int("n_heads", n_heads)
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"d_model / n_heads must be an even integer, got {d_model} / {n_heads}")
        self.n_heads, self.d_head, self.rope_base = n_heads, d_model // n_heads, rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, device=device, dtype=dtype)
        self.out_proj = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)

    def init_state(self, batch: int, device: torch.device | str | None = None) -> AttentionState:
        w = self.qkv.weight
        empty = torch.zeros(batch, self.n_heads, 0, self.d_head, device=device or w.device,
                            dtype=w.dtype)
        return AttentionState(empty, empty)

    def forward(self, x: torch.Tensor,
                state: AttentionState | None = None) -> torch.Tensor | tuple[torch.Tensor, AttentionState]:
        B, L, _ = x.shape
        q, k, v = heads(self.qkv(x), 3 * self.n_heads).transpose(1, 2).chunk(3, 1)
        offset = 0 if state is None else state.k.shape[2]
        q, k = rotary(q, offset, self.rope_base), rotary(k, offset, self.rope_base)
        if state is not None:
            k, v = torch.cat([state.k.to(k.dtype), k], 2), torch.cat([state.v.to(v.dtype), v], 2)
        if offset == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(L, device=x.device)[:, None] + offset
            mask = torch.arange(offset + L, device=x.device)[None, :] <= i
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.out_proj(o.transpose(1, 2).flatten(2))
        return y if state is None else (y, AttentionState(k, v))

    def step(self, x_t: torch.Tensor, state: AttentionState) -> tuple[torch.Tensor, AttentionState]:
        y, state = self.forward(x_t[:, None], state)
        return y[:, 0], state
