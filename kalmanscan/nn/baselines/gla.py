"""Gated linear attention (Yang et al. 2023; the ``"gla"`` mixer): fla's ``chunk_gla`` on CUDA when
installed, else a chunked torch form.

fla autotunes each kernel on first use (minutes per shape on a fresh machine). This module
leaves fla and Triton as they are: it patches neither. The benchmark and evidence harnesses may
import fla with its first configs beforehand (``KALMANSCAN_FLA_FIRST_CONFIG=1``,
``benchmarks/fla_first.py``), which this module then finds imported.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kalmanscan.nn.common import RMSNorm, causal_conv, empty_sequence, heads, positive_ints, scan_dtype

__all__ = ["GatedLinearAttention", "GLAState", "gla_chunked"]


@functools.cache
def _fla_chunk_gla():
    """fla's ``chunk_gla`` and whether it takes ``head_first``, or ``None`` when not installed
    (imported once)."""
    try:
        from fla.ops.gla import chunk_gla
    except ImportError:
        return None
    return chunk_gla, "head_first" in inspect.signature(chunk_gla).parameters


def gla_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float, state: torch.Tensor,
                chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated linear attention in chunks, in torch ops (the fallback for fla's ``chunk_gla``).

    Recurrence per head: ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``.
    q, k, g (B, L, H, K) with ``g <= 0`` the log decay; v (B, L, H, V); state (B, H, K, V).
    Returns ``o`` (B, L, H, V) and the final state, in the dtype of ``state``.

    Within a chunk of ``C`` tokens, with ``G`` the inclusive cumulative sum of ``g``, the output is
    ``scale q_i exp(G_i) S_0 + sum_{j <= i} scale (q_i . k_j exp(G_i - G_j)) v_j``; every
    exponent is ``<= 0`` (``exp(G_i - G_j)`` is formed only for ``j <= i``), so nothing overflows.
    Memory: a (B, H, L / C, C, C, K) tensor of pairwise decays.
    """
    B, L, H, K = q.shape
    dtype = state.dtype
    pad = -L % chunk
    q, k, v, g = (F.pad(t.to(dtype), (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
    n = (L + pad) // chunk
    q, k, v, g = (t.unflatten(1, (n, chunk)).permute(0, 3, 1, 2, 4) for t in (q, k, v, g))
    G = g.cumsum(-2)                                            # (B, H, n, C, K)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], -math.inf)
    A = (q[..., :, None, :] * k[..., None, :, :] * diff.exp()).sum(-1) * scale
    o = A @ v                                                   # (B, H, n, C, V)
    q_in = q * G.exp() * scale
    k_out = k * (G[..., -1:, :] - G).exp()
    decay_all = G[..., -1, :].exp()                             # (B, H, n, K)
    inter = []
    for i in range(n):
        inter.append(q_in[:, :, i] @ state)
        state = decay_all[:, :, i, :, None] * state + k_out[:, :, i].transpose(-1, -2) @ v[:, :, i]
    o = o + torch.stack(inter, 2)
    return o.permute(0, 2, 3, 1, 4).flatten(1, 2)[:, :L], state


class GLAState(NamedTuple):
    """``conv`` (B, d_conv - 1, 2 H K + H V): the pre-conv q, k, v window (width 0 without the
    short conv); ``S`` (B, H, K, V): the recurrent state (float32, or float64 for a float64 layer)."""

    conv: torch.Tensor
    S: torch.Tensor


class GatedLinearAttention(nn.Module):
    """Gated linear attention (Yang et al., arXiv 2312.06635) with data-dependent diagonal decay.

    Key width ``expand_k * D``, value width ``expand_v * D`` over ``n_heads`` heads; the log
    decay ``g = logsigmoid(W2 W1 x + b) / gate_normalizer`` comes from a rank-``gate_rank``
    projection; the output is ``o_proj(RMSNorm_head(o) * SiLU(W_g x))``. With ``d_conv > 0`` a
    causal depthwise conv of width ``d_conv`` + SiLU runs on q, k and v (fla's
    ``use_short_conv``, off by default there and here; KLA, Mamba, GDN and mLSTM have theirs on).
    On CUDA with fla installed the chunked Triton kernel ``chunk_gla`` runs; otherwise
    :func:`gla_chunked`. The recurrent state is :class:`GLAState`.
    """

    def __init__(self, d_model: int, n_heads: int = 4, expand_k: float = 0.5, expand_v: float = 1.0,
                 gate_rank: int = 16, gate_normalizer: float = 16.0, d_conv: int = 0,
                 use_fla: bool = True, device=None, dtype=None):
        super().__init__()
        positive_ints(n_heads=n_heads, gate_rank=gate_rank)
        if not isinstance(d_conv, int) or d_conv < 0:
            raise ValueError(f"d_conv must be a non-negative integer, got {d_conv!r}")
        key_dim, value_dim = int(d_model * expand_k), int(d_model * expand_v)
        if key_dim < n_heads or value_dim < n_heads or key_dim % n_heads or value_dim % n_heads:
            raise ValueError(f"expand_k * d_model and expand_v * d_model must be positive multiples "
                             f"of n_heads={n_heads}, got {key_dim} and {value_dim}")
        factory = dict(bias=False, device=device, dtype=dtype)
        self.n_heads, self.gate_normalizer, self.use_fla = n_heads, gate_normalizer, use_fla
        # fla is resolved here, not in forward, so that torch.compile never traces its import
        self._fla = _fla_chunk_gla() if use_fla and torch.cuda.is_available() else None
        self.d_key, self.d_value, self.d_conv = key_dim // n_heads, value_dim // n_heads, d_conv
        self.widths = [key_dim, key_dim, value_dim]
        self.qkv_proj = nn.Linear(d_model, sum(self.widths), **factory)
        self.conv = None if d_conv == 0 else nn.Conv1d(
            sum(self.widths), sum(self.widths), d_conv, groups=sum(self.widths), device=device, dtype=dtype)
        self.g_proj = nn.Linear(d_model, value_dim, **factory)
        self.gk_down = nn.Linear(d_model, gate_rank, **factory)
        self.gk_up = nn.Linear(gate_rank, key_dim, bias=True, device=device, dtype=dtype)
        self.o_norm = RMSNorm(self.d_value, device=device, dtype=dtype)
        self.o_proj = nn.Linear(value_dim, d_model, **factory)

    def init_state(self, batch: int, device: torch.device | str | None = None) -> GLAState:
        """Zero conv window and zero ``S``."""
        w = self.qkv_proj.weight
        device = device or w.device
        conv = torch.zeros(batch, max(self.d_conv - 1, 0), sum(self.widths), device=device, dtype=w.dtype)
        S = torch.zeros(batch, self.n_heads, self.d_key, self.d_value, device=device, dtype=scan_dtype(w))
        return GLAState(conv, S)

    def _check_state(self, state, batch: int):
        want = (batch, self.n_heads, self.d_key, self.d_value)
        if state is not None and (not isinstance(state, GLAState) or tuple(state.S.shape) != want):
            got = tuple(state.S.shape) if isinstance(state, GLAState) else type(state).__name__
            raise ValueError(f"state must be a GLAState with S of shape (batch, n_heads, d_key, "
                             f"d_value) = {want}, got {got}")

    def _qkvg(self, x, window):
        """x (B, L, D) -> q, k, g (B, L, H, K), v (B, L, H, V) and the new conv window."""
        qkv = self.qkv_proj(x)
        if self.conv is not None:
            qkv, window = causal_conv(qkv, window, self.conv)
            qkv = F.silu(qkv)
        q, k, v = (heads(t, self.n_heads) for t in qkv.split(self.widths, -1))
        gate = heads(self.gk_up(self.gk_down(x)), self.n_heads).to(scan_dtype(x))
        return q, k, v, F.logsigmoid(gate) / self.gate_normalizer, window

    def _output(self, o, x):
        gate = heads(F.silu(self.g_proj(x)), self.n_heads)
        return self.o_proj((self.o_norm(o.to(x.dtype)) * gate).flatten(-2))

    def forward(self, x: torch.Tensor, state: GLAState | None = None) -> torch.Tensor | tuple[torch.Tensor, GLAState]:
        """x (B, L, D) -> y (B, L, D); with ``state``, ``(y, new_state)`` (chunked prefill)."""
        self._check_state(state, x.shape[0])
        if x.ndim == 3 and x.shape[1] == 0:
            return empty_sequence(x, state)
        start = self.init_state(x.shape[0], x.device) if state is None else state
        q, k, v, g, window = self._qkvg(x, start.conv)
        scale = self.d_key ** -0.5
        fla = self._fla if self.use_fla and x.is_cuda else None
        if fla is not None:
            chunk_gla, has_head_first = fla
            extra = dict(head_first=False) if has_head_first else {}
            o, S = chunk_gla(q, k, v, g, scale=scale, initial_state=None if state is None else state.S,
                             output_final_state=state is not None, **extra)
        else:
            o, S = gla_chunked(q, k, v, g, scale, start.S)
        y = self._output(o, x)
        return y if state is None else (y, GLAState(window, S))

    def step(self, x_t: torch.Tensor, state: GLAState) -> tuple[torch.Tensor, GLAState]:
        """One token: x_t (B, D) -> ``(y_t (B, D), state)``."""
        self._check_state(state, x_t.shape[0])
        q, k, v, g, window = self._qkvg(x_t[:, None], state.conv)
        q, k, v, g = (t[:, 0].to(state.S.dtype) for t in (q, k, v, g))    # (B, H, K) / (B, H, V)
        S = g.exp()[..., None] * state.S + k[..., None] * v[..., None, :]
        o = (q[..., None] * S).sum(-2) * self.d_key ** -0.5
        return self._output(o, x_t), GLAState(window, S)
