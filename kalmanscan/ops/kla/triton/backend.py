"""The ``"triton"`` backend of :func:`kalmanscan.ops.kla.kla_scan`: the fused kernels, called through
their ``torch.library`` operators (:mod:`kalmanscan.ops.kla.triton.library`: launches, fake shapes, autograd).

Forward (:mod:`kalmanscan.kernels.kla.fwd`): one program per ``(batch, BLOCK_M channels)``, the
``[BLOCK_M, S]`` state grid in registers, time walked sequentially (optionally split into stretches
run by separate programs, :mod:`kalmanscan.kernels.kla.split`); under autograd it saves only the state at each
chunk start (``2 B M S ceil(L / CHUNK)`` floats).
Backward (:mod:`kalmanscan.kernels.kla.bwd`): chunks in reverse, each recomputed from its checkpoint, then the
scalar-adjoint reverse recursion (optionally split into stretches of time whose affine adjoint maps
are composed first, in one forward walk each: :mod:`kalmanscan.kernels.kla.adjoint_map`); exact
gradients for ``v, lam_v, k, q, decay, noise`` and the initial state.
``k``/``q`` gradients are reduced over M through per-program partials
(``B L ceil(M / BLOCK_M) S`` floats each) summed afterwards: deterministic, no atomics.

Arithmetic is float32 whatever the input dtype; ``y``/``y_var`` come back in ``v``'s dtype, the
final state ``(lam, eta)`` in float32, gradients in each input's dtype.

Accuracy. The kernels carry the precision ``lam`` (up to ``1/noise`` plus the observations'
``phi = lam_v k^2``) and, in the backward, the adjoints ``(gs, ge)`` (:mod:`kalmanscan.kernels.kla.bwd`:
the precision's adjoint ``gl`` would cancel against ``ge mu`` where ``lam`` is large). For a loss on
``y`` and ``y_var`` every gradient keeps float32's accuracy, at initial precisions from 1e-12 to
1e12 and without process noise (``tests/ops/kla/test_oracle.py``). A loss on the returned final
state reaches the kernels as the cotangents of ``(lam, eta)``; read as ``state.var``, ``state.mu``
(computed from them), its mean's part arrives as ``glam = -g_mu mu / lam`` and ``geta = g_mu /
lam``, which cancel in ``gs = glam + geta mu``: the decay and noise gradients then carry a
relative error up to about ``10 eps (1 + lam_max)``, ``lam_max`` the largest precision after the
first token (``eps = 2^-23``; measured 1e-5 at noise 1e-3; without noise at ``lam0 = 1e12`` the
bound exceeds 1: -6.8e4 against 34.5). The cpu backend (mean form) has no such term.
"""

from __future__ import annotations

import dataclasses

import torch

from kalmanscan.kernels.kla.split import kla_piece_map_kernel

from kalmanscan.model import merged
from kalmanscan.ops.launch import cdiv, next_power_of_2
from kalmanscan.ops.kla.triton.library import (DEFAULT_CONFIG, KLAConfig, filled, forward, kla_scan_fwd, launch_config,
                                               pieces, scratch_elements)
from kalmanscan.ops.kla.state import FilterState

__all__ = ["kla_scan", "kla_scan_triton", "summary", "KLAConfig", "DEFAULT_CONFIG"]

KERNEL_PROGRAMS = 1 << 14  # programs the piece-map summary aims for (pieces x batch x channel blocks)
MIN_PIECE = 64             # shortest piece of tokens worth a program of the piece-map summary


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor, initial_state: FilterState | None = None,
             config: KLAConfig | None = None, variance: bool = True,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, FilterState]:
    """``(y, y_var, state)``: the signature every KLA backend shares (:func:`kla_scan_triton` with
    ``initial_state`` a pair ``(lam, eta)`` or ``None``, the state a :class:`FilterState`);
    ``variance=False``: ``y_var`` is ``None``, not computed."""
    lam0, eta0 = (None, None) if initial_state is None else initial_state
    y, y_var, lam, eta = kla_scan_triton(v, lam_v, k, q, decay, noise, lam0, eta0, config, variance, cu_seqlens)
    return y, y_var, FilterState.from_information(lam, eta)


def kla_scan_triton(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                    noise: torch.Tensor,
                    lam0: torch.Tensor | None = None, eta0: torch.Tensor | None = None,
                    config: KLAConfig | None = None, variance: bool = True,
                    cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Fused KLA scan; returns ``(y, y_var, lam, eta)`` (shapes as :func:`kalmanscan.ops.kla.kla_scan`);
    with ``variance=False`` (or a ``config`` without it) ``y_var`` is ``None``: the kernels neither
    compute nor store it, nor read its gradient. ``cu_seqlens``: packed documents
    (:mod:`kalmanscan.ops.kla.documents`; ``lam0``, ``eta0`` and the state ``(N, M, S)``).

    Differentiable with respect to every tensor argument, traceable by ``torch.compile`` and
    capturable in a CUDA graph (the operator ``kalmanscan::kla_scan_fwd``, no host synchronisation).
    A call that needs no gradient, outside ``torch.compile``, runs the operator's implementation
    directly (:func:`~kalmanscan.ops.kla.triton.library.forward`: the same launches without the
    operator's dispatch). ``config`` (a :class:`KLAConfig`) overrides the launch shape (default:
    :func:`~kalmanscan.ops.kla.triton.library.launch_config`, remembered per shape); results do not
    depend on it beyond float32 rounding.
    """
    if config is None:
        config = _launch(*v.shape, next_power_of_2(k.shape[-1]), v.device, variance)
    else:
        if not variance and config.variance:
            config = dataclasses.replace(config, variance=False)
        _check_offsets(config, *v.shape, next_power_of_2(k.shape[-1]), v.device)
    tensors = (v, lam_v, k, q, decay, noise, lam0, eta0)
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    args = (v, lam_v, k, q, decay, noise, lam0, eta0, save, config.as_ints(), cu_seqlens)
    if not save and not torch.compiler.is_compiling() and type(v) is torch.Tensor:
        y, y_var, lam, eta = forward(*args, placeholder=torch.empty)[:4]
    else:
        y, y_var, lam, eta = kla_scan_fwd(*args)[:4]
    return y, y_var if config.variance else None, lam, eta


_LAUNCHES: dict = {}


def _launch(B, L, M, block_s, device, variance):
    """:func:`~kalmanscan.ops.kla.triton.library.launch_config` with its offsets checked
    (:func:`_check_offsets`), remembered per shape and device outside ``torch.compile``."""
    key = (B, L, M, block_s, device, variance)
    config = None if torch.compiler.is_compiling() else _LAUNCHES.get(key)
    if config is None:
        config = launch_config(B, L, M, device, variance)
        _check_offsets(config, B, L, M, block_s, device)
        if not torch.compiler.is_compiling() and len(_LAUNCHES) < 256:
            _LAUNCHES[key] = config
    return config


def _check_offsets(config, B, L, M, block_s, device):
    """``ValueError`` where a tensor a kernel indexes would pass the kernels' int32 offsets."""
    if _largest_buffer(config, B, L, M, block_s, device) >= 2**31:
        raise ValueError(f"v of shape {(B, L, M)} is too large for the kernels' int32 offsets")


def _largest_buffer(config, B, L, M, S, device):
    """Elements in the largest tensor a kernel indexes (the kernels use int32 offsets)."""
    n_mblocks = cdiv(M, config.bwd_block_m)
    fwd_pieces = pieces(config.pieces, config.block_m, config.chunk, B, L, M, device)[0]
    bwd_pieces = pieces(config.bwd_pieces, config.bwd_block_m, config.chunk, B, L, M, device, config.bwd_per_sm)[0]
    return max(B * L * M, B * L * n_mblocks * S, B * (cdiv(L, config.chunk) + 1) * M * S,
               B * max(7 * fwd_pieces, 5 * bwd_pieces) * M * S,
               scratch_elements(config, B, M, S, bwd_pieces))


def summary(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
            noise: torch.Tensor,
            dtype: torch.dtype, config: KLAConfig | None = None) -> tuple[torch.Tensor, ...]:
    """The product of every token's step (7 tensors ``(B, M, S)``, :mod:`kalmanscan.model.merged`) from
    the triton backend's piece-map kernel (float32, divided by the trace
    after every token; forward only; the ``[BLOCK_M, BLOCK_S]`` grid whatever
    ``config.states_first``), in ``dtype``.

    The tokens are cut into ``P`` pieces so that about :data:`KERNEL_PROGRAMS` programs walk them
    at once (pieces of at least :data:`MIN_PIECE` tokens); the ``P`` piece maps are then composed
    by a tree.
    """
    config = DEFAULT_CONFIG if config is None else config
    B, L, M = v.shape
    S = k.shape[-1]
    n_mblocks = cdiv(M, config.block_m)
    pieces = max(1, min(cdiv(KERNEL_PROGRAMS, B * n_mblocks), cdiv(L, MIN_PIECE)))
    piece_len = cdiv(L, pieces)
    pieces = cdiv(L, piece_len)
    maps = torch.empty(B, pieces + 1, 7, M, S, dtype=torch.float32, device=v.device)
    decay32, noise32 = (x.detach().to(torch.float32).contiguous() for x in (decay, noise))
    kla_piece_map_kernel[(B, n_mblocks, pieces)](
        *(x.contiguous() for x in (v, lam_v, k, q)), decay32, noise32, maps, decay32, decay32, decay32,
        L, M, S, piece_len, pieces + 1, BLOCK_M=config.block_m, BLOCK_S=next_power_of_2(S),
        STAGES=config.stages, STATES_FIRST=False, EVEN=config.even and filled(M, S, config.block_m),
        HAS_INIT=False, VARLEN=False, num_warps=config.num_warps)
    total = merged.total(merged.compose, maps[:, :pieces].unbind(2), 1)
    return tuple(x[:, 0].to(dtype) for x in total)
