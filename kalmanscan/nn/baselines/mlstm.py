"""The mLSTM mixer (Beck et al., "xLSTM: Extended Long Short-Term Memory", arXiv 2405.04517): the
matrix-memory cell in plain torch, registered as ``MIXERS["mlstm"]``.

Recurrence per head, with input-gate pre-activation ``i~_t``, log forget gate
``log f_t = logsigmoid(f~_t)`` and stabiliser ``m``:

    m_t = max(log f_t + m_{t-1}, i~_t)
    C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(i~_t - m_t) v_t k_t^T       (d_v, d_k)
    n_t = exp(log f_t + m_{t-1} - m_t) n_{t-1} + exp(i~_t - m_t) k_t             (d_k)
    h_t = C_t q_t / max(|n_t . q_t|, exp(-m_t))

Convention: a state ``(C, n, m)`` stands for the unstabilised memory ``(exp(m) C, exp(m) n)`` =
``(C^, n^)`` with ``C^_t = f_t C^_{t-1} + exp(i~_t) v_t k_t^T``, and every form here computes
``h_t = C^_t q_t / max(|n^_t . q_t|, 1)``, which does not depend on the stabiliser. Every exponent
formed is ``<= 0``, so nothing overflows. :func:`mlstm_sequential` (the reference, used for
decoding) and :func:`mlstm_chunkwise` (for training) reach the same ``m_t`` in exact arithmetic,
so their outputs and states agree up to rounding. The stabilisers ``m_t`` formed inside carry no
gradient: the outputs are invariant to them, so the dropped terms cancel exactly (the initial
``m`` of a given state does carry gradient: it scales that state's memory).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kalmanscan.nn.common import (RMSNorm, causal_conv, empty_sequence, inner_width, positive_int, positive_ints,
                                  scan_dtype)

__all__ = ["MLSTM", "MLSTMState", "mlstm_sequential", "mlstm_chunkwise"]


def _initial(q, v, state):
    """``state`` as ``(C, n, m)``, or the zero memory with ``m = 0`` in the scan dtype of ``q``."""
    if state is not None:
        return tuple(state)
    B, _, H, d_k = q.shape
    C = q.new_zeros(B, H, v.shape[-1], d_k, dtype=scan_dtype(q))
    return C, C.new_zeros(B, H, d_k), C.new_zeros(B, H)


def mlstm_sequential(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i_pre: torch.Tensor, log_f: torch.Tensor,
                     state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The mLSTM recurrence one token at a time (the reference, O(L) Python steps).

    q, k (B, L, H, d_k); v (B, L, H, d_v); i_pre, log_f (B, L, H) with ``log_f <= 0``;
    state ``(C (B, H, d_v, d_k), n (B, H, d_k), m (B, H))`` or ``None`` (zero memory, ``m = 0``).
    Returns ``h`` (B, L, H, d_v) and the final ``(C, n, m)``, computed in the dtype of ``C``.
    """
    C, n, m = _initial(q, v, state)
    q, k, v, i_pre, log_f = (t.to(C.dtype) for t in (q, k, v, i_pre, log_f))
    hs = []
    for t in range(q.shape[1]):
        m_new = torch.maximum(log_f[:, t] + m, i_pre[:, t]).detach()
        f_t, i_t = torch.exp(log_f[:, t] + m - m_new), torch.exp(i_pre[:, t] - m_new)
        C = f_t[..., None, None] * C + i_t[..., None, None] * v[:, t, ..., None] * k[:, t, :, None]
        n = f_t[..., None] * n + i_t[..., None] * k[:, t]
        m = m_new
        num = (C @ q[:, t, ..., None])[..., 0]
        den = (n * q[:, t]).sum(-1)
        hs.append(num / torch.maximum(den.abs(), torch.exp(-m))[..., None])
    return torch.stack(hs, 1), (C, n, m)


def mlstm_chunkwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i_pre: torch.Tensor, log_f: torch.Tensor,
                    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    chunk: int = 64) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The mLSTM recurrence in chunks: the parallel (attention-like) form within a chunk of
    ``chunk`` tokens, the state ``(C, n, m)`` passed between chunks. Same arguments, result and
    dtype as :func:`mlstm_sequential`.

    Within a chunk, with ``b_i = sum_{k <= i} log f_k`` (from the chunk start) and the decay matrix
    ``D_ij = b_i - b_j + i~_j`` (``j <= i``, else ``-inf``), the row stabiliser is
    ``m_i = max(b_i + m_0, max_j D_ij)`` (equal to the sequential ``m_i``) and

        num_i = exp(b_i + m_0 - m_i) C_0 q_i + sum_j exp(D_ij - m_i) (q_i . k_j) v_j
        den_i = exp(b_i + m_0 - m_i) n_0 . q_i + sum_j exp(D_ij - m_i) (q_i . k_j)
        h_i = num_i / max(|den_i|, exp(-m_i)).

    The intra-chunk terms of all chunks run at once; a loop over the ``L / chunk`` chunks carries
    the state. A last partial chunk is padded with ``log f = 0``, ``i~ = -inf``: no decay and no
    input, so the final state is the state after token ``L``. Memory: (B, H, L, chunk).
    """
    positive_int("chunk", chunk)
    B, L, H, _ = q.shape
    C, n, m = _initial(q, v, state)
    pad = -L % chunk
    N = (L + pad) // chunk

    def blocks(t, value=0.0):
        """(B, L, H, ...) -> (B, H, N, chunk, ...), padded with ``value``."""
        t = F.pad(t.to(C.dtype), (0, 0) * (t.ndim - 2) + (0, pad), value=value)
        return t.unflatten(1, (N, chunk)).movedim(3, 1)

    q, k, v, log_f = (blocks(t) for t in (q, k, v, log_f))
    i_pre = blocks(i_pre, -math.inf)
    b = log_f.cumsum(-1)                                        # (B, H, N, c)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    D = (b[..., :, None] - b[..., None, :] + i_pre[..., None, :]).masked_fill(~causal, -math.inf)
    m_intra = D.amax(-1).detach()
    P = (q @ k.transpose(-1, -2)) * torch.exp(D - m_intra[..., None])
    num_intra, den_intra = P @ v, P.sum(-1)

    g = b[..., -1]                                              # (B, H, N): log decay of a chunk
    w = g[..., None] - b + i_pre                                # weight of token j at chunk end
    m_local = w.amax(-1).detach()
    a = torch.exp(w - m_local[..., None])
    C_local = (v * a[..., None]).transpose(-1, -2) @ k          # (B, H, N, d_v, d_k)
    n_local = (k * a[..., None]).sum(-2)                        # (B, H, N, d_k)
    starts = []
    for j in range(N):
        starts.append((C, n, m))
        m_new = torch.maximum(g[..., j] + m, m_local[..., j]).detach()
        decay, scale = torch.exp(g[..., j] + m - m_new), torch.exp(m_local[..., j] - m_new)
        C = decay[..., None, None] * C + scale[..., None, None] * C_local[:, :, j]
        n = decay[..., None] * n + scale[..., None] * n_local[:, :, j]
        m = m_new
    C_0, n_0, m_0 = (torch.stack(s, 2) for s in zip(*starts))

    inter = b + m_0[..., None]
    m_row = torch.maximum(inter, m_intra).detach()
    s_inter, s_intra = torch.exp(inter - m_row), torch.exp(m_intra - m_row)
    num = s_inter[..., None] * (q @ C_0.transpose(-1, -2)) + s_intra[..., None] * num_intra
    den = s_inter * (q @ n_0[..., None])[..., 0] + s_intra * den_intra
    h = num / torch.maximum(den.abs(), torch.exp(-m_row))[..., None]
    return h.movedim(1, 3).flatten(1, 2)[:, :L], (C, n, m)


class MLSTMState(NamedTuple):
    """``conv`` (B, d_conv - 1, M): the pre-conv window; ``C`` (B, H, d_v, d_k), ``n`` (B, H, d_k),
    ``m`` (B, H): the stabilised memory (float32, float64 for a float64 layer)."""

    conv: torch.Tensor
    C: torch.Tensor
    n: torch.Tensor
    m: torch.Tensor


class MLSTM(nn.Module):
    """The mLSTM block of xLSTM (arXiv 2405.04517), simplified like the other baselines.

    up_proj D -> 2M (x_m, z), ``M = expand * D``; causal depthwise conv (width ``d_conv``) + SiLU
    on x_m gives c; ``q = W_q c``, ``k = W_k c / sqrt(d_head)``, ``v = W_v x_m`` over ``n_heads``
    heads of ``d_head = M / n_heads``; per-head scalar gates ``(i~, f~) = W_g [q, k, v] + b_g``;
    the recurrence of this module; per-head RMSNorm of h; ``(h + skip * c) * SiLU(z)``; down_proj.
    Gate weights start at zero, the input-gate bias at N(0, 0.1^2), the forget-gate bias spread
    over [3, 6] (as in the xLSTM code). ``forward`` runs :func:`mlstm_chunkwise` (chunks of
    ``chunk_size``), ``step`` runs :func:`mlstm_sequential` for one token.

    Numerics: projections run in the input dtype (bf16 under autocast); the recurrence runs in
    float32 (float64 for a float64 layer) with autocast off.
    """

    def __init__(self, d_model: int, n_heads: int = 4, expand: float = 2, d_conv: int = 4,
                 chunk_size: int = 64, device=None, dtype=None):
        super().__init__()
        positive_ints(d_model=d_model, n_heads=n_heads, d_conv=d_conv, chunk_size=chunk_size)
        M = inner_width(d_model, expand)
        if M % n_heads:
            raise ValueError(f"n_heads must divide expand * d_model = {M}, got n_heads={n_heads}")
        factory = dict(device=device, dtype=dtype)
        self.d_inner, self.n_heads, self.d_head = M, n_heads, M // n_heads
        self.d_conv, self.chunk_size = d_conv, chunk_size
        self.up_proj = nn.Linear(d_model, 2 * M, bias=False, **factory)
        self.conv = nn.Conv1d(M, M, d_conv, groups=M, bias=True, **factory)
        self.q_proj = nn.Linear(M, M, bias=False, **factory)
        self.k_proj = nn.Linear(M, M, bias=False, **factory)
        self.v_proj = nn.Linear(M, M, bias=False, **factory)
        self.gate_proj = nn.Linear(3 * M, 2 * n_heads, bias=True, **factory)
        self.o_norm = RMSNorm(self.d_head, **factory)
        self.skip = nn.Parameter(torch.ones(M, **factory))
        self.down_proj = nn.Linear(M, d_model, bias=False, **factory)
        with torch.no_grad():
            self.gate_proj.weight.zero_()
            self.gate_proj.bias[:n_heads].normal_(0.0, 0.1)
            self.gate_proj.bias[n_heads:].copy_(torch.linspace(3.0, 6.0, n_heads))

    def init_state(self, batch: int, device: torch.device | str | None = None) -> MLSTMState:
        """Zero conv window and memory, ``m = 0``."""
        w = self.up_proj.weight
        device = device or w.device
        conv = torch.zeros(batch, self.d_conv - 1, self.d_inner, device=device, dtype=w.dtype)
        C = torch.zeros(batch, self.n_heads, self.d_head, self.d_head, device=device,
                        dtype=scan_dtype(w))
        return MLSTMState(conv, C, C.new_zeros(C.shape[:3]), C.new_zeros(C.shape[:2]))

    def _check_state(self, state, batch: int):
        want = (batch, self.n_heads, self.d_head, self.d_head)
        if state is not None and tuple(state.C.shape) != want:
            raise ValueError(f"state.C must have shape (batch, n_heads, d_head, d_head) = {want}, "
                             f"got {tuple(state.C.shape)}")

    def _mix(self, x, state, recurrence):
        """x (B, L, D) -> y (B, L, D) and the new state, running ``recurrence`` on the heads."""
        start = self.init_state(x.shape[0], x.device) if state is None else state
        x_m, z = self.up_proj(x).chunk(2, -1)
        c, window = causal_conv(x_m, start.conv, self.conv)
        c = F.silu(c)
        q, k, v = self.q_proj(c), self.k_proj(c), self.v_proj(x_m)
        i_pre, f_pre = self.gate_proj(torch.cat([q, k, v], -1)).chunk(2, -1)
        def heads(t):
            return t.unflatten(-1, (self.n_heads, self.d_head))

        dtype = start.C.dtype
        with torch.autocast(x.device.type, enabled=False):
            h, (C, n, m) = recurrence(heads(q), heads(k).to(dtype) * self.d_head ** -0.5, heads(v),
                                      i_pre.to(dtype), F.logsigmoid(f_pre.to(dtype)),
                                      (start.C, start.n, start.m))
        h = self.o_norm(h).to(c.dtype).flatten(-2)
        y = self.down_proj((h + self.skip.to(c.dtype) * c) * F.silu(z))
        return y, MLSTMState(window, C, n, m)

    def forward(self, x: torch.Tensor,
                state: MLSTMState | None = None) -> torch.Tensor | tuple[torch.Tensor, MLSTMState]:
        """x (B, L, D) -> y (B, L, D); with ``state``, ``(y, new_state)`` (chunked prefill)."""
        self._check_state(state, x.shape[0])
        if x.ndim == 3 and x.shape[1] == 0:
            return empty_sequence(x, state)
        y, new_state = self._mix(x, state, partial(mlstm_chunkwise, chunk=self.chunk_size))
        return y if state is None else (y, new_state)

    def step(self, x_t: torch.Tensor, state: MLSTMState) -> tuple[torch.Tensor, MLSTMState]:
        """One token: x_t (B, D) -> ``(y_t (B, D), state)``; the memory update is O(H d_head^2)."""
        self._check_state(state, x_t.shape[0])
        y, state = self._mix(x_t[:, None], state, mlstm_sequential)
        return y[:, 0], state
