"""Kalman Linear Attention (KLA): the sequence-mixing scan, the layer, and a small sequence model.

    ks.nn.kla_scan(v, lam_v, k, q, decay, noise) -> (y, y_var)
    ks.nn.KLA(d_model, d_state=16, expand=2, ...)
    ks.nn.SequenceModel(vocab_size, d_model, n_layers, mixer="kla", ...)
    ks.nn.layer_filters(layer, x) -> (obs, post)     # a KLA layer's filters as ks.filter's
    ks.nn.initial_statistics(layer, x) -> dict       # what its filters do (kalmanscan.nn.init)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "kla_scan": "..ops.kla",
    "KLA": ".layer",
    "SequenceModel": ".model",
    "MIXERS": ".mixers",
    "register_mixer": ".mixers",
    "layer_filters": ".filters",
    "initial_statistics": ".init",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kalmanscan.nn' has no attribute {name!r}")
