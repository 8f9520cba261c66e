"""The byte-level language models compared on text (:mod:`evidence.lm`), at equal parameter count.

Every model is a :class:`kalmanscan.nn.SequenceModel` of ``DEPTH`` blocks [mixer, SwiGLU] with the
library's defaults (SwiGLU ratio 4 rounded to 64, ``weight_init="normal"``, KLA ``init="authors"``,
``d_state`` 16, ``expand`` 2) over the 256 byte values; only the mixers and the width differ:

    attention    8 x attention                       d_model 448, heads of 64
    kla          8 x KLA                             d_model 400
    gla          8 x GLA with its width-4 short conv d_model 448, 7 heads
    kla_hybrid   2 x [KLA, KLA, KLA, attention]      d_model 416, attention heads of 32
    gla_hybrid   2 x [GLA, GLA, GLA, attention]      d_model 448, heads of 64

The widths put every model within ``PARITY_TOLERANCE`` of every other's parameter count (about 20M;
:func:`parameter_counts` counts them on the meta device, :func:`check_parity` asserts it). KLA's
layer is wider per channel than attention's (``expand`` 2 and its value-precision path), so it
gets the narrower residual stream; 400 is the multiple of 16 nearest to parity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tasks.text import VOCAB_SIZE

DEPTH = 8
PARITY_TOLERANCE = 0.05       # largest parameter count / smallest - 1


@dataclass(frozen=True)
class LMSpec:
    """One model: the repeated ``pattern`` of mixers, its width, the attention/GLA head width
    (``n_heads = d_model // head_dim``) and keywords for its mixers."""

    pattern: tuple
    d_model: int
    head_dim: int | None = None
    options: tuple = ()


LM_MODELS = {
    "attention": LMSpec(("attention",), 448, 64),
    "kla": LMSpec(("kla",), 400),
    "gla": LMSpec(("gla",), 448, 64, (("d_conv", 4),)),
    "kla_hybrid": LMSpec(("kla", "kla", "kla", "attention"), 416, 32),
    "gla_hybrid": LMSpec(("gla", "gla", "gla", "attention"), 448, 64, (("d_conv", 4),)),
}


def model_spec(name: str) -> LMSpec:
    if name not in LM_MODELS:
        raise ValueError(f"model must be one of {sorted(LM_MODELS)}, got {name!r}")
    return LM_MODELS[name]


def layer_mixers(name: str, layers: int = DEPTH) -> list:
    """The mixer of each of ``layers`` blocks: the model's pattern repeated (and cut)."""
    pattern = model_spec(name).pattern
    return [pattern[i % len(pattern)] for i in range(layers)]


def build_lm(name: str, d_model: int | None = None, layers: int = DEPTH, device=None) -> torch.nn.Module:
    """The model ``name`` of ``LM_MODELS``; ``d_model`` overrides its width (small models for tests),
    the head count following from the spec's head width (at least one head)."""
    from kalmanscan.nn import SequenceModel

    spec = model_spec(name)
    d_model = spec.d_model if d_model is None else d_model
    mixers = layer_mixers(name, layers)
    options = dict(spec.options) if "gla" in mixers else {}
    if spec.head_dim is not None and ("attention" in mixers or "gla" in mixers):
        heads = max(1, d_model // spec.head_dim)
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of the {heads} heads of model {name!r}")
        options["n_heads"] = heads
    return SequenceModel(VOCAB_SIZE, d_model, layers, mixer=mixers, device=device, **options)


def parameter_counts(names=tuple(LM_MODELS), layers: int = DEPTH) -> dict:
    """``{name: parameters}`` of the full-size models, built on the meta device (no memory, fast)."""
    counts = {}
    for name in names:
        model = build_lm(name, layers=layers, device="meta")
        counts[name] = sum(p.numel() for p in model.parameters())
    return counts


def check_parity(counts: dict, tolerance: float = PARITY_TOLERANCE) -> float:
    """The spread ``max / min - 1`` of ``counts``; a ``ValueError`` naming the extremes when it
    exceeds ``tolerance``."""
    low, high = min(counts, key=counts.get), max(counts, key=counts.get)
    spread = counts[high] / counts[low] - 1.0
    if spread > tolerance:
        raise ValueError(f"parameter counts differ by {spread:.1%} > {tolerance:.0%}: "
                         f"{high} {counts[high]:,} vs {low} {counts[low]:,}")
    return spread
