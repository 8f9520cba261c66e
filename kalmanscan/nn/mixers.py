"""Sequence mixers for :class:`kalmanscan.nn.SequenceModel`, by name, and the baselines KLA is
compared with.

    MIXERS["kla"]        Kalman Linear Attention (:class:`kalmanscan.nn.KLA`)
    MIXERS["attention"]  causal softmax attention with rotary positions and a KV cache
    MIXERS["gla"]        gated linear attention (Yang et al. 2023): fla's ``chunk_gla`` on CUDA when
                         installed, else a chunked torch form
    MIXERS["mamba"]      a Mamba-like selective diagonal SSM (input-dependent step, torch only)
    MIXERS["gdn"]        Gated DeltaNet (:mod:`kalmanscan.nn.gdn`, chunked torch form)
    MIXERS["mlstm"]      xLSTM's matrix-memory mLSTM (:mod:`kalmanscan.nn.mlstm`, chunkwise torch form)

Protocol (every mixer): ``Mixer(d_model, **kwargs, device=None, dtype=None)``;
``forward(x, state=None)`` with x (B, L, D) returns y (B, L, D), or ``(y, new_state)`` when a state
is given (chunked prefill); ``step(x_t, state) -> (y_t, state)`` with x_t (B, D);
``init_state(batch, device=None)`` is the state before the first token.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import mobius
from ..scan import associative_scan
from .layer import (KLA, causal_conv, init_log_dt, init_log_rates, inner_width, positive_int,
                    positive_ints, scan_dtype)
from .model import RMSNorm

__all__ = ["MIXERS", "register_mixer", "CausalAttention", "GatedLinearAttention", "GLAState",
           "SelectiveSSM", "gla_chunked"]

MIXERS: dict = {}


def register_mixer(name: str):
    """Decorator: register a mixer constructor (usually an ``nn.Module`` class) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")

    def register(constructor):
        MIXERS[name] = constructor
        return constructor

    return register


register_mixer("kla")(KLA)


def _heads(x, n_heads):
    """(B, L, H * d) -> (B, L, H, d)."""
    return x.unflatten(-1, (n_heads, -1))


# --------------------------------------------------------------------------- attention


class AttentionState(NamedTuple):
    """KV cache: ``k``, ``v`` (B, H, T, d_head) for the T tokens seen so far."""

    k: torch.Tensor
    v: torch.Tensor


def rotary(x, offset: int, base: float):
    """Rotary position embedding of x (B, H, L, d) at positions ``offset .. offset + L - 1``."""
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    pos = torch.arange(offset, offset + x.shape[-2], device=x.device, dtype=torch.float32)
    angle = pos[:, None] * inv_freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@register_mixer("attention")
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

    def init_state(self, batch: int, device=None) -> AttentionState:
        w = self.qkv.weight
        empty = torch.zeros(batch, self.n_heads, 0, self.d_head, device=device or w.device,
                            dtype=w.dtype)
        return AttentionState(empty, empty)

    def forward(self, x, state: AttentionState | None = None):
        B, L, _ = x.shape
        q, k, v = _heads(self.qkv(x), 3 * self.n_heads).transpose(1, 2).chunk(3, 1)
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

    def step(self, x_t, state: AttentionState):
        y, state = self.forward(x_t[:, None], state)
        return y[:, 0], state


# --------------------------------------------------------------------------- gated linear attention


def _fla_chunk_gla():
    """fla's ``chunk_gla`` and whether it takes ``head_first``, or ``None`` when not installed."""
    try:
        from fla.ops.gla import chunk_gla
    except ImportError:
        return None
    return chunk_gla, "head_first" in inspect.signature(chunk_gla).parameters


def gla_chunked(q, k, v, g, scale: float, state, chunk: int = 16):
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


@register_mixer("gla")
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

    def init_state(self, batch: int, device=None) -> GLAState:
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
        q, k, v = (_heads(t, self.n_heads) for t in qkv.split(self.widths, -1))
        gate = _heads(self.gk_up(self.gk_down(x)), self.n_heads).to(scan_dtype(x))
        return q, k, v, F.logsigmoid(gate) / self.gate_normalizer, window

    def _output(self, o, x):
        gate = _heads(F.silu(self.g_proj(x)), self.n_heads)
        return self.o_proj((self.o_norm(o.to(x.dtype)) * gate).flatten(-2))

    def forward(self, x, state: GLAState | None = None):
        """x (B, L, D) -> y (B, L, D); with ``state``, ``(y, new_state)`` (chunked prefill)."""
        self._check_state(state, x.shape[0])
        start = self.init_state(x.shape[0], x.device) if state is None else state
        q, k, v, g, window = self._qkvg(x, start.conv)
        scale = self.d_key ** -0.5
        fla = _fla_chunk_gla() if self.use_fla and x.is_cuda else None
        if fla is not None:
            chunk_gla, has_head_first = fla
            extra = dict(head_first=False) if has_head_first else {}
            o, S = chunk_gla(q, k, v, g, scale=scale, initial_state=None if state is None else state.S,
                             output_final_state=state is not None, **extra)
        else:
            o, S = gla_chunked(q, k, v, g, scale, start.S)
        y = self._output(o, x)
        return y if state is None else (y, GLAState(window, S))

    def step(self, x_t, state: GLAState):
        """One token: x_t (B, D) -> ``(y_t (B, D), state)``."""
        self._check_state(state, x_t.shape[0])
        q, k, v, g, window = self._qkvg(x_t[:, None], state.conv)
        q, k, v, g = (t[:, 0].to(state.S.dtype) for t in (q, k, v, g))    # (B, H, K) / (B, H, V)
        S = g.exp()[..., None] * state.S + k[..., None] * v[..., None, :]
        o = (q[..., None] * S).sum(-2) * self.d_key ** -0.5
        return self._output(o, x_t), GLAState(window, S)


# --------------------------------------------------------------------------- selective SSM


class SSMState(NamedTuple):
    """``conv`` (B, d_conv - 1, M) pre-conv window; ``h`` (B, M, S) the SSM state."""

    conv: torch.Tensor
    h: torch.Tensor


@register_mixer("mamba")
class SelectiveSSM(nn.Module):
    """A Mamba-like selective diagonal SSM (Gu and Dao, arXiv 2312.00752), the baseline in torch.

    in_proj D -> 2M (z, gate); causal depthwise conv + SiLU on z; per token a step
    ``dt = softplus(W_dt (W_x z)_r + b)`` (M), input and output maps ``B, C`` (S);
    ``h <- exp(-dt theta) h + dt B z``, ``y = C . h + D_skip z``; ``y SiLU(gate)``; out_proj.
    ``theta = exp(log_theta)`` has the S4D-real init ``1..S``; ``dt`` starts log-uniform in
    ``[dt_min, dt_max]``. The scan is :func:`kalmanscan.scan.associative_scan` over
    the affine maps of :mod:`kalmanscan.mobius` and materialises (B, L, M, S).
    """

    def __init__(self, d_model: int, d_state: int = 16, expand: float = 2, d_conv: int = 4,
                 dt_rank: int | None = None, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 device=None, dtype=None):
        super().__init__()
        positive_ints(d_state=d_state, d_conv=d_conv)
        M = inner_width(d_model, expand)
        factory = dict(device=device, dtype=dtype)
        self.d_inner, self.d_state, self.d_conv = M, d_state, d_conv
        self.dt_rank = dt_rank or math.ceil(d_model / 16)
        positive_int("dt_rank", self.dt_rank)
        self.in_proj = nn.Linear(d_model, 2 * M, bias=False, **factory)
        self.conv = nn.Conv1d(M, M, d_conv, groups=M, bias=True, **factory)
        self.x_proj = nn.Linear(M, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, M, bias=True, **factory)
        self.out_proj = nn.Linear(M, d_model, bias=False, **factory)
        with torch.no_grad():
            dt = init_log_dt(M, dt_min, dt_max, **factory).exp()
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))   # softplus^-1(dt)
        self.log_theta = nn.Parameter(init_log_rates(M, d_state, **factory))
        self.skip = nn.Parameter(torch.ones(M, **factory))

    def init_state(self, batch: int, device=None) -> SSMState:
        w = self.in_proj.weight
        device = device or w.device
        conv = torch.zeros(batch, self.d_conv - 1, self.d_inner, device=device, dtype=w.dtype)
        h = torch.zeros(batch, self.d_inner, self.d_state, device=device, dtype=scan_dtype(w))
        return SSMState(conv, h)

    def _maps(self, z):
        """z (..., M) -> per-token decay and input (..., M, S), and C (..., S), in the scan dtype."""
        dtype = scan_dtype(z)
        dt_low, B, C = self.x_proj(z).split([self.dt_rank, self.d_state, self.d_state], -1)
        dt = F.softplus(self.dt_proj(dt_low).to(dtype))
        decay = torch.exp(-dt[..., None] * self.log_theta.to(dtype).exp())
        inp = (dt * z.to(dtype))[..., None] * B.to(dtype)[..., None, :]
        return decay, inp, C.to(dtype)

    def _output(self, h, C, z, gate):
        y = (h * C[..., None, :]).sum(-1).to(z.dtype) + self.skip.to(z.dtype) * z
        return self.out_proj(y * F.silu(gate))

    def forward(self, x, state: SSMState | None = None):
        z, gate = self.in_proj(x).chunk(2, -1)
        start = self.init_state(x.shape[0], x.device) if state is None else state
        z, window = causal_conv(z, start.conv, self.conv)
        z = F.silu(z)
        decay, inp, C = self._maps(z)
        F_, B_ = associative_scan(mobius.affine_compose, (decay, inp), dim=1)
        h = F_ * start.h[:, None].to(F_.dtype) + B_
        y = self._output(h, C, z, gate)
        return y if state is None else (y, SSMState(window, h[:, -1]))

    def step(self, x_t, state: SSMState):
        z, gate = self.in_proj(x_t).chunk(2, -1)
        z, window = causal_conv(z[:, None], state.conv, self.conv)
        z = F.silu(z[:, 0])
        decay, inp, C = self._maps(z)
        h = decay * state.h.to(decay.dtype) + inp
        return self._output(h, C, z, gate), SSMState(window, h)


from . import gdn, gru, mlstm  # noqa: E402,F401 - after register_mixer: they register "gdn", "gru", "mlstm"
