"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464): the gated delta rule as a mixer.

    MIXERS["gdn"]  :class:`GatedDeltaNet`

Per head, with the state ``S`` (K, V) (keys index the rows), a decay ``alpha_t = exp(g_t)`` in
(0, 1] and a write strength ``beta_t`` in (0, 1):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = scale S_t^T q_t

:func:`gated_delta_rule_sequential` runs it token by token (the reference, and decoding);
:func:`gated_delta_rule_chunked` runs it in chunks of ``C`` tokens with one triangular solve per
chunk (the WY / UT form of Yang et al., arXiv 2406.06484, with the decays folded in), so training
loops over ``L / C`` chunks rather than ``L`` tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kalmanscan.nn.common import (RMSNorm, causal_conv, empty_sequence, init_log_dt, inner_width, l2_normalize,
                                  positive_int, positive_ints, scan_dtype)

__all__ = ["GatedDeltaNet", "GDNState", "gated_delta_rule_chunked", "gated_delta_rule_sequential"]


def gated_delta_rule_sequential(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                                scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (O(L) Python steps: the reference form).

    q, k (B, L, H, K); v (B, L, H, V); g (B, L, H) the log decay (``<= 0``); beta (B, L, H);
    state (B, H, K, V). Computes in the dtype of ``state`` and returns ``o`` (B, L, H, V) and the
    final state. Each step is ``S = alpha S_{t-1}``, ``u = beta (v - S^T k)``, ``S_t = S + k u^T``.
    """
    dtype = state.dtype
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    outs = []
    for t in range(q.shape[1]):
        S = g[:, t].exp()[..., None, None] * state
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        state = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o, state


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             scale: float, state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of ``chunk`` tokens; same arguments and result as
    :func:`gated_delta_rule_sequential`.

    Within a chunk, with ``G_i`` the inclusive cumulative sum of ``g`` and ``S_0`` the state at
    its start, write ``S_i = alpha_i S_{i-1} + k_i u_i^T`` with
    ``u_i = beta_i (v_i - alpha_i S_{i-1}^T k_i)``. Unrolling gives the unit lower-triangular
    system ``(I + A) U = diag(beta) V - diag(beta e^G) K S_0`` with
    ``A_ij = beta_i e^(G_i - G_j) k_i . k_j`` for ``j < i``, solved once per chunk for both
    right-hand sides: ``U = U_0 - W S_0``. Then, with ``P_ij = e^(G_i - G_j) q_i . k_j`` for
    ``j <= i``,

        O = scale (P U_0 + (diag(e^G) Q - P W) S_0),
        S_C = (e^(G_C) I - K_end^T W) S_0 + K_end^T U_0,     K_end = diag(e^(G_C - G)) K,

    all batched over chunks; only ``S_0`` passes from chunk to chunk (a loop of ``L / C`` steps).
    Every exponent is ``<= 0`` (``e^(G_i - G_j)`` is formed only for ``j <= i``), so nothing
    overflows. The tail is padded with ``g = 0, beta = 0`` tokens, which leave the state alone.
    Memory: (B, H, L / C, C, C) for ``A`` and ``P``, (B, H, L / C, K, K) for the chunk maps.
    """
    positive_int("chunk", chunk)
    B, L, H, K = q.shape
    V = v.shape[-1]
    dtype = state.dtype
    pad = -L % chunk
    n = (L + pad) // chunk
    q, k, v = (F.pad(t.to(dtype), (0, 0, 0, 0, 0, pad)).unflatten(1, (n, chunk)).transpose(2, 3)
               .transpose(1, 2) for t in (q, k, v))                    # (B, H, n, C, .)
    g, beta = (F.pad(t.to(dtype), (0, 0, 0, pad)).unflatten(1, (n, chunk)).permute(0, 3, 1, 2)
               for t in (g, beta))                                     # (B, H, n, C)
    G = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, -math.inf).exp()
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * ratio).tril(-1)
    eye = torch.eye(chunk, dtype=dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], -1)
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U0, W = UW.split([V, K], -1)
    P = (q @ k.transpose(-1, -2)) * ratio
    o_intra = P @ U0                                                   # (B, H, n, C, V)
    q_start = q * G.exp()[..., None] - P @ W                           # (B, H, n, C, K)
    k_end = (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)  # (B, H, n, K, C)
    M = G[..., -1, None, None].exp() * torch.eye(K, dtype=dtype, device=q.device) - k_end @ W
    N = k_end @ U0                                                     # (B, H, n, K, V)
    outs = []
    for i in range(n):
        outs.append(o_intra[:, :, i] + q_start[:, :, i] @ state)
        state = M[:, :, i] @ state + N[:, :, i]
    o = scale * torch.stack(outs, 2)
    return o.permute(0, 2, 3, 1, 4).flatten(1, 2)[:, :L], state


class GDNState(NamedTuple):
    """``conv`` (B, d_conv - 1, 2 H K + H V): the pre-conv q, k, v window; ``S`` (B, H, K, V): the
    delta-rule state (float32, or float64 for a float64 layer)."""

    conv: torch.Tensor
    S: torch.Tensor


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464), a baseline in torch.

    in_proj D -> q, k (H x K, ``K = D / H``), v (H x V, ``V = expand D / H``); a causal depthwise
    conv (width ``d_conv``) + SiLU on q, k, v; q, k L2-normalised per head; per token and head the
    log decay ``g = -exp(A_log) softplus(a_proj x + dt_bias)`` and ``beta = sigmoid(b_proj x)``;
    the gated delta rule with ``scale = K^-0.5`` (module docstring); per-head RMSNorm of ``o``,
    times ``SiLU(g_proj x)``; out_proj V H -> D. ``exp(A_log)`` starts uniform in [1, 16] and
    ``softplus(dt_bias)`` log-uniform in [1e-3, 1e-1], as in the paper's code.

    ``forward`` runs :func:`gated_delta_rule_chunked` (chunks of ``chunk_size``); ``step`` runs
    :func:`gated_delta_rule_sequential` for one token. Numerics: projections and the conv run in
    the input dtype (bf16 under autocast); the gates and the recurrence run in float32 (float64
    for float64 inputs), with autocast off.
    """

    def __init__(self, d_model: int, n_heads: int = 4, expand: float = 2, d_conv: int = 4,
                 chunk_size: int = 64, device=None, dtype=None):
        super().__init__()
        positive_ints(d_model=d_model, n_heads=n_heads, d_conv=d_conv, chunk_size=chunk_size)
        value_dim = inner_width(d_model, expand)
        if d_model % n_heads or value_dim % n_heads:
            raise ValueError(f"d_model and expand * d_model must be multiples of "
                             f"n_heads={n_heads}, got {d_model} and {value_dim}")
        factory = dict(device=device, dtype=dtype)
        self.d_model, self.n_heads, self.d_conv = d_model, n_heads, d_conv
        self.chunk_size = chunk_size
        self.d_key, self.d_value = d_model // n_heads, value_dim // n_heads
        self.widths = [d_model, d_model, value_dim]
        self.in_proj = nn.Linear(d_model, sum(self.widths), bias=False, **factory)
        self.conv = nn.Conv1d(sum(self.widths), sum(self.widths), d_conv, groups=sum(self.widths),
                              bias=True, **factory)
        self.a_proj = nn.Linear(d_model, n_heads, bias=False, **factory)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False, **factory)
        self.g_proj = nn.Linear(d_model, value_dim, bias=False, **factory)
        self.o_norm = RMSNorm(self.d_value, **factory)
        self.out_proj = nn.Linear(value_dim, d_model, bias=False, **factory)
        with torch.no_grad():
            dt = init_log_dt(n_heads, 1e-3, 1e-1, **factory).exp()
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))    # softplus^-1(dt)
            self.A_log = nn.Parameter(torch.empty(n_heads, **factory).uniform_(1, 16).log())
        for p in (self.dt_bias, self.A_log):
            p._no_weight_decay = True

    def init_state(self, batch: int, device: torch.device | str | None = None) -> GDNState:
        """Zero conv window and zero ``S``."""
        w = self.in_proj.weight
        device = w.device if device is None else device
        conv = torch.zeros(batch, self.d_conv - 1, sum(self.widths), device=device, dtype=w.dtype)
        S = torch.zeros(batch, self.n_heads, self.d_key, self.d_value, device=device,
                        dtype=scan_dtype(w))
        return GDNState(conv, S)

    def _check(self, x, ndim, name, state):
        if x.ndim != ndim or x.shape[-1] != self.d_model:
            want = "(B, L, D)" if ndim == 3 else "(B, D)"
            raise ValueError(f"{name} must have shape {want} with D = {self.d_model}, "
                             f"got {tuple(x.shape)}")
        want = (x.shape[0], self.n_heads, self.d_key, self.d_value)
        if state is not None and tuple(state.S.shape) != want:
            raise ValueError(f"state.S must have shape (batch, n_heads, d_key, d_value) = {want}, "
                             f"got {tuple(state.S.shape)}")

    def inputs(self, x: torch.Tensor, window: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """x (B, L, D) -> q, k (B, L, H, K), v (B, L, H, V), g, beta (B, L, H) in the scan dtype,
        and the new conv window."""
        qkv, window = causal_conv(self.in_proj(x), window, self.conv)
        dtype = scan_dtype(x)
        q, k, v = (F.silu(t).unflatten(-1, (self.n_heads, -1)).to(dtype)
                   for t in qkv.split(self.widths, -1))
        dt = F.softplus(self.a_proj(x).to(dtype) + self.dt_bias.to(dtype))
        g = -self.A_log.to(dtype).exp() * dt
        beta = torch.sigmoid(self.b_proj(x).to(dtype))
        return l2_normalize(q), l2_normalize(k), v, g, beta, window

    def _output(self, o, x):
        gate = F.silu(self.g_proj(x)).unflatten(-1, (self.n_heads, -1))
        return self.out_proj((self.o_norm(o.to(x.dtype)) * gate).flatten(-2))

    def forward(self, x: torch.Tensor, state: GDNState | None = None) -> torch.Tensor | tuple[torch.Tensor, GDNState]:
        """x (B, L, D) -> y (B, L, D); with ``state``, ``(y, new_state)`` (chunked prefill)."""
        self._check(x, 3, "x", state)
        if x.shape[1] == 0:
            return empty_sequence(x, state)
        start = self.init_state(x.shape[0], x.device) if state is None else state
        q, k, v, g, beta, window = self.inputs(x, start.conv)
        with torch.autocast(x.device.type, enabled=False):
            o, S = gated_delta_rule_chunked(q, k, v, g, beta, self.d_key ** -0.5,
                                            start.S.to(q.dtype), self.chunk_size)
        y = self._output(o, x)
        return y if state is None else (y, GDNState(window, S))

    def step(self, x_t: torch.Tensor, state: GDNState) -> tuple[torch.Tensor, GDNState]:
        """One token in O(H K V) work: x_t (B, D) -> ``(y_t (B, D), state)``."""
        self._check(x_t, 2, "x_t", state)
        q, k, v, g, beta, window = self.inputs(x_t[:, None], state.conv)
        with torch.autocast(x_t.device.type, enabled=False):
            o, S = gated_delta_rule_sequential(q, k, v, g, beta, self.d_key ** -0.5,
                                               state.S.to(q.dtype))
        return self._output(o[:, 0], x_t), GDNState(window, S)
