"""A gated recurrent unit mixer (Cho et al., arXiv 1406.1078): the nonlinear recurrent control,
registered as ``MIXERS["gru"]``.

    x (B, L, D) -> GRU (hidden H = expand * D, one layer) -> h (B, L, H) -> out_proj -> (B, L, D)

Its state update ``h_t = (1 - u_t) h_{t-1} + u_t tanh(W x_t + r_t * (U h_{t-1}))`` is nonlinear in
``h_{t-1}``, which no diagonal linear scan (KLA, GLA, the selective SSM) is. Recurrent networks of
this kind track the state of non-solvable groups such as A5 with one layer (Merrill et al., "The
Illusion of State in State-Space Models", arXiv 2404.08819), so on the group tasks it is the
positive control of the harness: a task setting this mixer does not learn says more about the
setting than about the scans. The cost is a sequential loop over L (cuDNN's on CUDA).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kalmanscan.nn.common import empty_sequence, inner_width

__all__ = ["GRUMixer", "GRUState"]


class GRUState(NamedTuple):
    """``h`` (B, H): the hidden state after the last token."""

    h: torch.Tensor


class GRUMixer(nn.Module):
    """One GRU layer of hidden width ``H = expand * d_model`` and a linear map back to ``d_model``.

    ``forward(x)`` with x (B, L, D) returns (B, L, D); with a ``state`` it continues that state and
    also returns the new one. ``step(x_t, state)`` advances one token (B, D). The state is kept
    in the parameters' dtype.
    """

    def __init__(self, d_model: int, expand: float = 2, device=None, dtype=None):
        super().__init__()
        H = inner_width(d_model, expand)
        factory = dict(device=device, dtype=dtype)
        self.d_model, self.d_hidden = d_model, H
        self.rnn = nn.GRU(d_model, H, batch_first=True, **factory)
        self.out_proj = nn.Linear(H, d_model, bias=False, **factory)

    def init_state(self, batch: int, device: torch.device | str | None = None) -> GRUState:
        """The zero hidden state."""
        w = self.out_proj.weight
        return GRUState(torch.zeros(batch, self.d_hidden, device=device or w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor, state: GRUState | None = None) -> torch.Tensor | tuple[torch.Tensor, GRUState]:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, L, D) with D = {self.d_model}, got {tuple(x.shape)}")
        if x.shape[1] == 0:
            return empty_sequence(x, state)
        h0 = None if state is None else state.h[None].to(x.dtype)
        h, h_last = self.rnn(x, h0)
        y = self.out_proj(h)
        return y if state is None else (y, GRUState(h_last[0]))

    def step(self, x_t: torch.Tensor, state: GRUState) -> tuple[torch.Tensor, GRUState]:
        y, state = self.forward(x_t[:, None], state)
        return y[:, 0], state
