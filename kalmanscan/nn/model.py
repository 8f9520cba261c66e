"""A small pre-norm sequence model around any registered mixer (docs/math.md).

    tokens (B, L) -> embedding -> N x [x + mixer(RMSNorm x);  x + SwiGLU(RMSNorm x)]
                  -> RMSNorm -> head -> logits (B, L, vocab_size)

The mixer of each layer comes from :data:`kalmanscan.nn.mixers.MIXERS` by name (``"kla"``,
``"attention"``, ``"gla"``, ``"mamba"``, ``"gdn"``, ``"mlstm"``, ``"gru"``, or any registered
one); a list of names builds a hybrid.
Every mixer follows one protocol: ``forward(x, state=None)`` returns ``y`` (and the new state when
one is given), ``step(x_t, state) -> (y_t, state)``, ``init_state(batch, device=None)``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


import torch.nn.functional as F
from torch import nn

from kalmanscan.nn.common import RMSNorm
from kalmanscan.nn.generate import generate, mixer_step, mlp_step, residual_norm, rms_norm_step
from kalmanscan.nn.init import WEIGHT_INIT_DEFAULT, WEIGHT_INITS, normal_init_
from kalmanscan.nn.mixers import MIXERS
from kalmanscan.ops.kla.documents import validate_cu_seqlens

__all__ = ["SequenceModel", "SwiGLU"]


class SwiGLU(nn.Module):
    """``W_out (SiLU(W_gate x) * W_up x)`` with hidden width ``int(2 mlp_ratio d / 3)`` (the
    parameter count of a plain MLP of ratio ``mlp_ratio``), rounded up to a multiple of
    ``multiple_of``.

    In bf16 a hidden width that is not a multiple of 8 leaves the rows of the hidden activations
    and of the weights' gradients off the 16-byte boundaries cuBLAS's tensor-core kernels are
    built for (``int(8 d / 3)`` is odd at d = 128 and 512), and cuBLAS falls back to older, slower
    kernels. ``multiple_of=64`` (the default) keeps them aligned for a few percent more parameters,
    as LLaMA's rounding does; ``multiple_of=1`` gives the unrounded width. H200, d = 512, 16,384
    tokens (``benchmarks/bench_gemms.py``): the six products of the block took 1.18 ms at width
    1365 and 0.32 ms at 1408 (docs/decisions.md, "The KLA model and its comparisons").
    """

    def __init__(self, d_model: int, mlp_ratio: float = 4.0, multiple_of: int = 64, device=None, dtype=None):
        super().__init__()
        if not isinstance(multiple_of, int) or multiple_of < 1:
            raise ValueError(f"multiple_of must be a positive integer, got {multiple_of!r}")
        hidden = int(2 * mlp_ratio * d_model / 3)
        if hidden < 1:
            raise ValueError(f"mlp_ratio must give a positive hidden width, got {mlp_ratio!r}")
        hidden = -(-hidden // multiple_of) * multiple_of
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False, device=device, dtype=dtype)
        self.w_out = nn.Linear(hidden, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_in(x).chunk(2, -1)
        return self.w_out(F.silu(gate) * up)


class Block(nn.Module):
    """``x + mixer(RMSNorm x)``, then ``x + SwiGLU(RMSNorm x)``."""

    def __init__(self, mixer: nn.Module, d_model: int, mlp_ratio: float, mlp_multiple_of: int = 64, device=None,
                 dtype=None):
        super().__init__()
        self.mixer_norm = RMSNorm(d_model, device=device, dtype=dtype)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(d_model, device=device, dtype=dtype)
        self.mlp = SwiGLU(d_model, mlp_ratio, mlp_multiple_of, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: Any = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        packed = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens)  # SequenceModel.forward checked it
        if state is None:
            x = x + self.mixer(self.mixer_norm(x), **packed)
        else:
            y, state = self.mixer(self.mixer_norm(x), state=state, **packed)
            x = x + y
        return x + self.mlp(self.mlp_norm(x)), state

    def step(self, x_t: torch.Tensor, state: Any, out: Any = None) -> tuple[torch.Tensor, Any]:
        """One token, x_t (B, D) -> ``(x_t, state)``; ``out``: the state to write the new one into
        (see :meth:`SequenceModel.step`)."""
        x_t, _, state = self.decode_step(x_t, rms_norm_step(self.mixer_norm, x_t), state, out)
        return x_t, state

    def decode_step(self, x_t: torch.Tensor, h: torch.Tensor, state: Any, out: Any = None,
                    next_norm: RMSNorm | None = None, fused: bool = False) -> tuple[torch.Tensor, Any, Any]:
        """One token given the residual stream ``x_t`` (B, D) and its mixer norm ``h``: ``(x_t, h_next,
        state)`` with ``h_next = next_norm(x_t)`` (``None`` without ``next_norm``).

        With ``fused`` each residual sum and the norm after it are one kernel, and so is the
        SwiGLU product (:mod:`kalmanscan.ops.block`); otherwise the norms are ``F.rms_norm`` where
        the weight has the input's dtype (the arithmetic of :class:`RMSNorm`)."""
        y, state = mixer_step(self.mixer, h, state, out)
        x_t, h = residual_norm(x_t, y, self.mlp_norm, fused)
        y = mlp_step(self.mlp, h, fused)
        if next_norm is None:
            return x_t + y, None, state
        x_t, h = residual_norm(x_t, y, next_norm, fused)
        return x_t, h, state


def _accepted(constructor, kwargs: dict) -> dict:
    """The entries of ``kwargs`` that ``constructor`` takes as keyword arguments."""
    params = inspect.signature(constructor).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


class SequenceModel(nn.Module):
    """Embedding, ``n_layers`` pre-norm blocks of [mixer, SwiGLU], final RMSNorm, linear head.

    Args:
        vocab_size, d_model, n_layers: sizes.
        mixer: a registered mixer name for every layer, or a list of ``n_layers`` names (a hybrid,
            e.g. ``["attention"] * (n - 1) + ["kla"]``).
        d_state, expand: passed to the mixers that take them (``kla``, ``mamba``).
        mlp_ratio: SwiGLU width ratio.
        mlp_multiple_of: the SwiGLU hidden width is rounded up to a multiple of this (default 64,
            which keeps bf16 rows aligned for cuBLAS; 1 for the unrounded width, see :class:`SwiGLU`).
        weight_init: ``"normal"`` (the default) or ``"torch"`` (each module's own initialisation,
            which trains faster at widths far below 128). With ``"normal"`` every ``nn.Linear`` and
            ``nn.Embedding`` weight of the model (every mixer alike, the MLPs, the head) is drawn
            from ``N(0, 0.02^2)`` after construction, as the KLA authors' sequence model does
            (:func:`kalmanscan.nn.init.normal_init_`: biases, convolutions, norms, the mixers'
            rates and weights a scheme fixes are kept).
        **mixer_kwargs: each passed to every mixer whose constructor takes it (e.g. ``n_heads``
            for attention and gla, ``variant``, ``init`` or ``backend`` for kla); one that no mixer
            in the model takes is a ``ValueError``. The defaults, ``init="authors"`` (for kla) and
            ``weight_init="normal"``, are the KLA authors' whole recipe.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, mixer="kla", d_state: int = 16,
                 expand: float = 2, mlp_ratio: float = 4.0, weight_init: str = WEIGHT_INIT_DEFAULT,
                 mlp_multiple_of: int = 64, **mixer_kwargs):
        super().__init__()
        if weight_init not in WEIGHT_INITS:
            raise ValueError(f"weight_init must be one of {WEIGHT_INITS}, got {weight_init!r}")

        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        names = [mixer] * n_layers if isinstance(mixer, str) else list(mixer)
        if len(names) != n_layers:
            raise ValueError(f"mixer must be a name or a list of n_layers={n_layers} names, "
                             f"got {len(names)} names")
        unknown = sorted({str(n) for n in names} - set(MIXERS))
        if unknown:
            raise ValueError(f"mixer: unknown name(s) {unknown}; registered: {sorted(MIXERS)}")
        factory = {k: mixer_kwargs.pop(k) for k in ("device", "dtype") if k in mixer_kwargs}
        shared = dict(d_state=d_state, expand=expand, **mixer_kwargs)
        used = set()
        mixers = []
        for name in names:
            kwargs = _accepted(MIXERS[name], shared)
            used.update(kwargs)
            mixers.append(MIXERS[name](d_model, **kwargs, **factory))
        unused = sorted(set(mixer_kwargs) - used)
        if unused:
            raise ValueError(f"mixer_kwargs {unused} are taken by none of the mixers {sorted(set(names))}")

        self.mixer_names = names
        self.embedding = nn.Embedding(vocab_size, d_model, **factory)
        self.blocks = nn.ModuleList(Block(m, d_model, mlp_ratio, mlp_multiple_of, **factory) for m in mixers)
        self.norm = RMSNorm(d_model, **factory)
        self.head = nn.Linear(d_model, vocab_size, bias=False, **factory)
        if weight_init == "normal":
            normal_init_(self)

    def init_state(self, batch: int, device: torch.device | str | None = None, capacity: int | None = None) -> list:
        """One recurrent state per layer, for decoding from the start of a sequence; ``capacity``:
        the tokens a cache should have room for, passed to the mixers whose ``init_state`` takes it
        (attention's KV cache)."""
        extra = {} if capacity is None else dict(capacity=capacity)
        return [b.mixer.init_state(batch, device=device, **_accepted(b.mixer.init_state, extra)) for b in self.blocks]

    def _check_packed(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        refusing = [n for n, b in zip(self.mixer_names, self.blocks)
                    if "cu_seqlens" not in inspect.signature(b.mixer.forward).parameters]
        if refusing:
            raise ValueError(f"cu_seqlens: the mixers {sorted(set(refusing))} do not take packed documents")
        validate_cu_seqlens(cu_seqlens, tokens)

    def _check_state(self, state: list | None) -> None:
        if state is not None and (not isinstance(state, (list, tuple)) or len(state) != len(self.blocks)):
            got = f"{len(state)} entries" if isinstance(state, (list, tuple)) else type(state).__name__
            raise ValueError(f"state must be a list of {len(self.blocks)} layer states (from init_state), got {got}")

    def forward(self, tokens: torch.Tensor, state: list | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, list]:
        """tokens (B, L) int -> logits (B, L, vocab_size); with ``state`` (from :meth:`init_state`
        or a previous call) continues the sequence and returns ``(logits, state)``: chunked prefill.

        ``cu_seqlens``: packed documents (fla's convention, :mod:`kalmanscan.ops.kla.documents`):
        ``tokens`` ``(1, total)`` holds ``N`` documents end to end, int32 offsets ``(N + 1,)``;
        every document's logits are those it gets alone. Checked here once (one read of the
        offsets: ``ValueError`` naming ``cu_seqlens``); every mixer must take ``cu_seqlens`` (KLA's
        does). A ``state`` then has one row per document (``init_state(N)``, or a previous packed
        call's): each document continues its own row, and the returned state holds every
        document's state after its last token (its rows can be decoded from by :meth:`step`).
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (B, L), got {tuple(tokens.shape)}")
        self._check_state(state)
        if cu_seqlens is not None:
            self._check_packed(tokens, cu_seqlens)
        x = self.embedding(tokens)
        new_state = None if state is None else []
        for i, block in enumerate(self.blocks):
            x, s = block(x, None if state is None else state[i], cu_seqlens)
            if state is not None:
                new_state.append(s)
        logits = self.head(self.norm(x))
        return logits if state is None else (logits, new_state)

    def step(self, token: torch.Tensor, state: list, *, out: list | None = None,
             fused: bool | None = None) -> tuple[torch.Tensor, list]:
        """One decoding step: token (B,) int -> ``(logits (B, vocab_size), state)``.

        ``out``: a list of layer states to write the new ones into (``out=state``: the state
        advances in place). Mixers whose ``step`` takes ``out`` (KLA, attention) write into it;
        for the others the new state's tensors are copied into it. With ``out=state`` the step
        keeps every tensor of the state where it is, so that it can be captured in a CUDA graph
        and replayed (:meth:`generate`); gradients are not recorded that way.

        ``fused``: each residual sum with the norm after it, and each SwiGLU product, as one
        kernel (:meth:`Block.decode_step`; not differentiable). Default: on CUDA below float64
        when no gradient is recorded; ``True`` runs the kernels anywhere (on the CPU through
        Triton's interpreter).
        """
        if token.ndim != 1:
            raise ValueError(f"token must have shape (B,), got {tuple(token.shape)}")
        self._check_state(state)
        self._check_state(out)
        x = self.embedding(token)
        if fused is None:
            recording = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
            fused = x.is_cuda and x.dtype != torch.float64 and not recording
        x, h = residual_norm(x, None, self.blocks[0].mixer_norm, fused)
        new_state = []
        for i, (block, s) in enumerate(zip(self.blocks, state)):
            next_norm = self.blocks[i + 1].mixer_norm if i + 1 < len(self.blocks) else self.norm
            x, h, s = block.decode_step(x, h, s, None if out is None else out[i], next_norm, fused)
            new_state.append(s)
        return self.head(h), new_state

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 *, prefill_chunk: int = 2048, cuda_graph: bool = False,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``prompt`` (B, P) int by ``max_new_tokens`` tokens: returns (B, P + max_new_tokens).

        The prompt is read by the forward (the scan for KLA) in chunks of ``prefill_chunk`` tokens,
        then each new token by :meth:`step` with the state advanced in place. ``temperature=0``
        picks the most likely token (greedy); above 0 the next token is drawn from
        ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely with ``top_k``
        (Gumbel-max sampling, with ``generator`` when given). ``cuda_graph=True`` (CUDA only)
        runs the first step eagerly, captures the next one (sampling included) in a
        ``torch.cuda.CUDAGraph`` and replays it for every further token: the same operations, so
        greedy output equals the eager loop's.
        """
        return generate(self, prompt, max_new_tokens, temperature, top_k, prefill_chunk=prefill_chunk,
                        cuda_graph=cuda_graph, generator=generator)
