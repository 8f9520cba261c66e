"""A Mamba-like selective diagonal SSM (the ``"mamba"`` mixer; input-dependent step, torch only)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kalmanscan.model import mobius
from kalmanscan.model.scan import associative_scan
from kalmanscan.nn.common import (causal_conv, empty_sequence, init_log_dt, init_log_rates, inner_width, positive_int,
                                  positive_ints, scan_dtype)

__all__ = ["SelectiveSSM", "SSMState"]


class SSMState(NamedTuple):
    """``conv`` (B, d_conv - 1, M) pre-conv window; ``h`` (B, M, S) the SSM state."""

    conv: torch.Tensor
    h: torch.Tensor


class SelectiveSSM(nn.Module):
    """A Mamba-like selective diagonal SSM (Gu and Dao, arXiv 2312.00752), the baseline in torch.

    in_proj D -> 2M (z, gate); causal depthwise conv + SiLU on z; per token a step
    ``dt = softplus(W_dt (W_x z)_r + b)`` (M), input and output maps ``B, C`` (S);
    ``h <- exp(-dt theta) h + dt B z``, ``y = C . h + D_skip z``; ``y SiLU(gate)``; out_proj.
    ``theta = exp(log_theta)`` has the S4D-real init ``1..S``; ``dt`` starts log-uniform in
    ``[dt_min, dt_max]``. The scan is :func:`kalmanscan.model.scan.associative_scan` over
    the affine maps of :mod:`kalmanscan.model.mobius` and materialises (B, L, M, S).
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

    def init_state(self, batch: int, device: torch.device | str | None = None) -> SSMState:
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

    def forward(self, x: torch.Tensor, state: SSMState | None = None) -> torch.Tensor | tuple[torch.Tensor, SSMState]:
        if x.ndim == 3 and x.shape[1] == 0:
            return empty_sequence(x, state)
        z, gate = self.in_proj(x).chunk(2, -1)
        start = self.init_state(x.shape[0], x.device) if state is None else state
        z, window = causal_conv(z, start.conv, self.conv)
        z = F.silu(z)
        decay, inp, C = self._maps(z)
        F_, B_ = associative_scan(mobius.affine_compose, (decay, inp), dim=1)
        h = F_ * start.h[:, None].to(F_.dtype) + B_
        y = self._output(h, C, z, gate)
        return y if state is None else (y, SSMState(window, h[:, -1]))

    def step(self, x_t: torch.Tensor, state: SSMState) -> tuple[torch.Tensor, SSMState]:
        z, gate = self.in_proj(x_t).chunk(2, -1)
        z, window = causal_conv(z[:, None], state.conv, self.conv)
        z = F.silu(z[:, 0])
        decay, inp, C = self._maps(z)
        h = decay * state.h.to(decay.dtype) + inp
        return self._output(h, C, z, gate), SSMState(window, h)
