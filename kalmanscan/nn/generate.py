"""Decoding a :class:`kalmanscan.nn.SequenceModel`: prefill by the forward, then one step a token,
the state advanced in place, optionally replayed from a CUDA graph.

    tokens = model.generate(prompt, max_new_tokens, temperature=0.0, top_k=None, cuda_graph=False)

A step that writes its new state into the old one's tensors (``model.step(token, state,
out=state)``) keeps every tensor where it is: captured once in a ``torch.cuda.CUDAGraph``, its
replay reads the current token from a fixed buffer, advances the state and writes the next token
back into that buffer, with no work on the host but the launch of the graph.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kalmanscan.ops.block import add_rms_norm, silu_mul

__all__ = ["generate", "next_token", "rms_norm_step", "mixer_step", "copy_state", "residual_norm", "mlp_step"]


def rms_norm_step(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for a :class:`kalmanscan.nn.common.RMSNorm`, as one fused ``F.rms_norm`` when
    its weight has ``x``'s dtype (same arithmetic: float32 for half-precision inputs)."""
    if norm.weight.dtype != x.dtype:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


@functools.cache
def _step_takes_out(cls: type) -> bool:
    return "out" in inspect.signature(cls.step).parameters


def copy_state(out: Any, new: Any) -> Any:
    """``new`` (a tuple or named tuple of a layer's state) with each tensor copied into the tensor
    of ``out`` in its place; other entries are ``new``'s."""
    leaves = [dst.copy_(src) if isinstance(dst, torch.Tensor) and dst is not src else
              (dst if isinstance(dst, torch.Tensor) else src) for dst, src in zip(out, new)]
    return type(new)(*leaves) if hasattr(new, "_fields") else type(new)(leaves)


def mixer_step(mixer: nn.Module, x_t: torch.Tensor, state: Any, out: Any = None) -> tuple[torch.Tensor, Any]:
    """``mixer.step(x_t, state)`` writing the new state into ``out``: passed on to a mixer whose step
    takes ``out=``, else the new state's tensors copied into it (:func:`copy_state`)."""
    if out is None:
        return mixer.step(x_t, state)
    if _step_takes_out(type(mixer)):
        return mixer.step(x_t, state, out=out)
    y, state = mixer.step(x_t, state)
    return y, copy_state(out, state)


def residual_norm(x: torch.Tensor, y: torch.Tensor | None, norm: nn.Module,
                  fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` for the residual sum ``s = x + y`` (``s = x`` for ``y=None``): one kernel with
    ``fused`` (:func:`kalmanscan.ops.block.add_rms_norm`)."""
    if fused:
        return add_rms_norm(x, y, norm.weight, norm.eps)
    s = x if y is None else x + y
    return s, rms_norm_step(norm, s)


def mlp_step(mlp: nn.Module, h: torch.Tensor, fused: bool) -> torch.Tensor:
    """``mlp(h)`` for a :class:`kalmanscan.nn.SwiGLU`, its product one kernel with ``fused``."""
    return mlp.w_out(silu_mul(mlp.w_in(h))) if fused else mlp(h)


def _contiguous(state: list) -> list:
    """Each layer's state with every tensor contiguous (copied where it is a view)."""
    return [type(s)(*(x.contiguous() if isinstance(x, torch.Tensor) else x for x in s)) if hasattr(s, "_fields")
            else type(s)(x.contiguous() if isinstance(x, torch.Tensor) else x for x in s) for s in state]


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token (B,) int64 from logits (B, V): the argmax for ``temperature = 0``, else a
    draw from ``softmax(logits / temperature)`` over the ``top_k`` largest (all with ``None``) by
    the Gumbel-max trick, ``argmax(logits / temperature - log E)`` with ``E ~ Exp(1)``: no value
    read on the host, so it can be captured in a CUDA graph."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    exp = torch.empty_like(logits).exponential_(generator=generator)
    return (logits - exp.log()).argmax(-1)


def _check(model: nn.Module, prompt: Any, max_new_tokens: Any, temperature: Any, top_k: Any, prefill_chunk: Any,
           cuda_graph: bool, generator: Any) -> None:
    if not isinstance(prompt, torch.Tensor) or prompt.ndim != 2 or prompt.shape[1] < 1 or prompt.is_floating_point():
        got = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
        raise ValueError(f"prompt must be an integer tensor of shape (B, P) with P >= 1, got {got}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    vocab = model.head.out_features
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(f"top_k must be None or an integer in [1, {vocab}], got {top_k!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
    if cuda_graph and (not prompt.is_cuda or generator is not None):
        raise ValueError("cuda_graph needs the prompt and the model on a CUDA device and generator=None")


def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, *, prefill_chunk: int = 2048, cuda_graph: bool = False,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """:meth:`kalmanscan.nn.SequenceModel.generate` (the arguments and result documented there)."""
    _check(model, prompt, max_new_tokens, temperature, top_k, prefill_chunk, cuda_graph, generator)
    B, P = prompt.shape
    tokens = torch.empty(B, P + max_new_tokens, dtype=torch.long, device=prompt.device)
    tokens[:, :P] = prompt
    if max_new_tokens == 0:
        return tokens
    state = model.init_state(B, prompt.device, capacity=P + max_new_tokens)
    for lo in range(0, P, prefill_chunk):
        logits, state = model(prompt[:, lo:lo + prefill_chunk], state=state)
    state = _contiguous(state)
    token = next_token(logits[:, -1], temperature, top_k, generator)
    tokens[:, P] = token

    def step(token):
        logits, _ = model.step(token, state, out=state)
        return next_token(logits, temperature, top_k, generator)

    n_steps = max_new_tokens - 1
    if not cuda_graph or n_steps < 2:
        for i in range(n_steps):
            token = step(token)
            tokens[:, P + 1 + i] = token
        return tokens
    token = step(token)                        # eager: compiles, tunes and fills every cache
    tokens[:, P + 1] = token
    current = token.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        current.copy_(step(current))
    for i in range(1, n_steps):
        graph.replay()
        tokens[:, P + 1 + i] = current
    return tokens
