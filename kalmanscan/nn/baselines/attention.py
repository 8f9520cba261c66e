"""Causal softmax attention with rotary positions and a KV cache (the ``"attention"`` mixer)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kalmanscan.nn.common import heads, positive_int

__all__ = ["CausalAttention", "AttentionState", "rotary", "rotary_table"]


class AttentionState(NamedTuple):
    """Static KV cache: ``k``, ``v`` (B, H, capacity, d_head), of which the first ``length``
    positions hold the keys and values of the tokens seen (the rest are zeros, free);
    ``pos`` the same count as a () int64 tensor on the cache's device, which a step reads (so that
    a step captured in a CUDA graph writes and attends at the right position on every replay).

    A forward or step writes the new keys and values into the free positions of the cache, in
    place while it has room (else into a cache of twice the capacity): the state passed keeps its
    meaning (its first ``length`` positions are unchanged), but two continuations of one state
    need a copy of it each."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    length: int

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@torch.library.custom_op("kalmanscan::rotary_table", mutates_args=())
def rotary_table(offset: int, length: int, dim: int, base: float, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary angles, each ``(length, dim // 2)`` in ``dtype``: position
    ``offset + i`` times ``base^(-2j / dim)``, computed in float32.

    An operator, so that ``torch.compile`` computes the table once a call: traced as plain
    operations, Inductor fuses ``cos`` and ``sin`` into the kernels that rotate ``q`` and ``k``
    and evaluates them for every batch row and head, at angles up to the sequence length in
    radians, where the range reduction is slow (docs/decisions.md, "The KLA model
    and its comparisons")."""
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
    positions; decoding reads a static KV cache (:class:`AttentionState`, O(T) work per token, as
    attention needs, and no copy of the cache)."""

    def __init__(self, d_model: int, n_heads: int = 4, rope_base: float = 10000.0,
                 device=None, dtype=None):
        super().__init__()
        positive_int("n_heads", n_heads)
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"d_model / n_heads must be an even integer, got {d_model} / {n_heads}")
        self.n_heads, self.d_head, self.rope_base = n_heads, d_model // n_heads, rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, device=device, dtype=dtype)
        self.out_proj = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)

    def init_state(self, batch: int, device: torch.device | str | None = None, capacity: int = 0) -> AttentionState:
        """An empty cache with room for ``capacity`` tokens (it grows when a call needs more)."""
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
        w = self.qkv.weight
        device = device or w.device
        k = torch.zeros(batch, self.n_heads, capacity, self.d_head, device=device, dtype=w.dtype)
        return AttentionState(k, torch.zeros_like(k), torch.zeros((), dtype=torch.long, device=device), 0)

    def _check_state(self, state: AttentionState, batch: int) -> None:
        want = (batch, self.n_heads, self.d_head)
        if not isinstance(state, AttentionState) or (state.k.shape[0], state.k.shape[1], state.k.shape[3]) != want:
            got = tuple(state.k.shape) if isinstance(state, AttentionState) else type(state).__name__
            raise ValueError(f"state must be an AttentionState with k of shape (batch, n_heads, capacity, d_head), "
                             f"(batch, n_heads, d_head) = {want}, got {got}")

    @staticmethod
    def _room(state: AttentionState, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache tensors with room for ``end`` tokens: the state's own, or (when full) new ones
        of at least twice the capacity holding its first ``length`` positions."""
        if end <= state.capacity:
            return state.k, state.v
        capacity = max(end, 2 * state.capacity, 16)
        grown = []
        for cache in (state.k, state.v):
            new = cache.new_zeros(*cache.shape[:2], capacity, cache.shape[3])
            new[:, :, :state.length] = cache[:, :, :state.length]
            grown.append(new)
        return grown[0], grown[1]

    def forward(self, x: torch.Tensor,
                state: AttentionState | None = None) -> torch.Tensor | tuple[torch.Tensor, AttentionState]:
        """x (B, L, D) -> y (B, L, D); with ``state``, ``(y, new_state)``: the tokens' keys and
        values are written into the cache at ``state.length .. state.length + L - 1``."""
        B, L, _ = x.shape
        q, k, v = heads(self.qkv(x), 3 * self.n_heads).transpose(1, 2).chunk(3, 1)
        offset = 0 if state is None else state.length
        q, k = rotary(q, offset, self.rope_base), rotary(k, offset, self.rope_base)
        if state is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out_proj(o.transpose(1, 2).flatten(2))
        self._check_state(state, B)
        end = offset + L
        cache_k, cache_v = self._room(state, end)
        cache_k[:, :, offset:end] = k
        cache_v[:, :, offset:end] = v
        k, v = cache_k[:, :, :end].to(q.dtype), cache_v[:, :, :end].to(q.dtype)
        if offset == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(L, device=x.device)[:, None] + offset
            mask = torch.arange(end, device=x.device)[None, :] <= i
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.out_proj(o.transpose(1, 2).flatten(2))
        return y, AttentionState(cache_k, cache_v, state.pos + L, end)

    def step(self, x_t: torch.Tensor, state: AttentionState, *,
             out: AttentionState | None = None) -> tuple[torch.Tensor, AttentionState]:
        """One token: x_t (B, D) -> ``(y_t (B, D), state)``.

        Writes the token's key and value into the cache at ``state.pos`` and attends over the
        whole capacity with the positions beyond it masked (O(capacity) work, the work of a
        static-cache decoder). The position, the rotary angles (read from a table of the
        capacity's positions) and the mask come from ``pos`` on the device: no value is read on
        the host. ``out=state`` advances ``pos`` in place (the
        step can then be captured in a CUDA graph and replayed once a token, while the capacity
        lasts); without it the returned ``pos`` is a new tensor.
        """
        if out is not None and out is not state:
            raise ValueError("out: the attention cache advances only in place (out=state)")
        B = x_t.shape[0]
        self._check_state(state, B)
        cache_k, cache_v = self._room(state, state.length + 1)
        H, d = self.n_heads, self.d_head
        qkv = self.qkv(x_t).view(B, 3 * H, d)
        table, positions = self._step_tables(cache_k.shape[2], x_t.device, x_t.dtype)
        index = state.pos.view(1)
        cos, sin = table.index_select(0, index).unbind(1)           # (1, d) each
        qk = qkv[:, :2 * H]
        swapped = qk.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)  # [x2, x1]
        qk = torch.addcmul(qk * cos, swapped, sin)                   # [x1 cos - x2 sin, x2 cos + x1 sin]
        cache_k.index_copy_(2, index, qk[:, H:, None].to(cache_k.dtype))
        cache_v.index_copy_(2, index, qkv[:, 2 * H:, None].to(cache_v.dtype))
        mask = (positions <= state.pos)[None]
        o = F.scaled_dot_product_attention(qk[:, :H, None], cache_k.to(qk.dtype), cache_v.to(qk.dtype),
                                           attn_mask=mask)
        y = self.out_proj(o.flatten(1))
        pos = state.pos.add_(1) if out is not None else state.pos + 1
        return y, AttentionState(cache_k, cache_v, pos, state.length + 1)

    def _step_tables(self, capacity: int, device: torch.device,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary table of the step, (capacity, 2, d_head): at each position ``[cos, cos]`` and
        ``[-sin, sin]`` of :func:`rotary_table`'s angles (the same values), and the positions
        ``0 .. capacity - 1``; made once per capacity, device and dtype (kept while the module
        lives, so a captured step keeps reading them)."""
        key = (capacity, device, dtype)
        tables = self.__dict__.setdefault("_tables_by_capacity", {})
        if key not in tables:
            cos, sin = rotary_table(0, capacity, self.d_head, self.rope_base, device, dtype)
            table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)
            tables[key] = table, torch.arange(capacity, device=device)
        return tables[key]
