"""Sequence mixers for :class:`kalmanscan.nn.SequenceModel`, by name, and the baselines KLA is
compared with.

    MIXERS["kla"]        Kalman Linear Attention (:class:`kalmanscan.nn.KLA`)
    MIXERS["attention"]  causal softmax attention with rotary positions and a KV cache
    MIXERS["gla"]        gated linear attention (Yang et al. 2023): fla's ``chunk_gla`` on CUDA when
                         installed, else a chunked torch form
    MIXERS["mamba"]      a Mamba-like selective diagonal SSM (input-dependent step, torch only)
    MIXERS["gdn"]        Gated DeltaNet (:mod:`kalmanscan.nn.baselines.gdn`, chunked torch form)
    MIXERS["mlstm"]      xLSTM's matrix-memory mLSTM (:mod:`kalmanscan.nn.baselines.mlstm`, chunkwise torch form)

Protocol (every mixer): ``Mixer(d_model, **kwargs, device=None, dtype=None)``;
``forward(x, state=None)`` with x (B, L, D) returns y (B, L, D), or ``(y, new_state)`` when a state
is given (chunked prefill); ``step(x_t, state) -> (y_t, state)`` with x_t (B, D);
``init_state(batch, device=None)`` is the state before the first token.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


from kalmanscan.nn.baselines.attention import CausalAttention
from kalmanscan.nn.baselines.gdn import GatedDeltaNet
from kalmanscan.nn.baselines.gla import GatedLinearAttention, GLAState, gla_chunked
from kalmanscan.nn.baselines.gru import GRUMixer
from kalmanscan.nn.baselines.mlstm import MLSTM
from kalmanscan.nn.baselines.ssm import SelectiveSSM
from kalmanscan.nn.layer import KLA

__all__ = ["MIXERS", "register_mixer", "CausalAttention", "GatedLinearAttention", "GLAState",
           "SelectiveSSM", "gla_chunked"]

MIXERS: dict = {"kla": KLA, "attention": CausalAttention, "gla": GatedLinearAttention,
                "mamba": SelectiveSSM, "gdn": GatedDeltaNet, "mlstm": MLSTM, "gru": GRUMixer}


def register_mixer(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: register a mixer constructor (usually an ``nn.Module`` class) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")

    def register(constructor):
        MIXERS[name] = constructor
        return constructor

    return register
