"""The ``"triton"`` backend of :func:`kalmanscan.ops.kla.kla_scan`: launch wrappers and autograd.

Forward (:mod:`kalmanscan.kernels.kla.fwd`): one program per ``(batch, BLOCK_M channels)``, the
``[BLOCK_M, S]`` state grid in registers, time walked sequentially (optionally split into stretches
run by separate programs, :mod:`kalmanscan.kernels.kla.split`); under autograd it saves only the state at each
chunk start (``2 B M S ceil(L / CHUNK)`` floats).
Backward (:mod:`kalmanscan.kernels.kla.bwd`): chunks in reverse, each recomputed from its checkpoint, then the
scalar-adjoint reverse recursion (optionally split into stretches of time whose affine adjoint maps
are composed first); exact gradients for ``v, lam_v, k, q, decay, noise`` and the initial state.
``k``/``q`` gradients are reduced over M through per-program partials
(``B L ceil(M / BLOCK_M) S`` floats each) summed afterwards: deterministic, no atomics.

Arithmetic is float32 whatever the input dtype; ``y``/``y_var`` come back in ``v``'s dtype, the
final state ``(lam, eta)`` in float32, gradients in each input's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kalmanscan.kernels.kla.bwd import kla_bwd_kernel
from kalmanscan.kernels.kla.fwd import kla_fwd_kernel
from kalmanscan.kernels.kla.split import kla_piece_map_kernel

from ... import merged
from ..launch import cdiv, next_power_of_2
from .state import FilterState

__all__ = ["kla_scan", "kla_scan_triton", "summary", "KLAConfig", "DEFAULT_CONFIG"]

KERNEL_PROGRAMS = 1 << 14  # programs the piece-map summary aims for (pieces x batch x channel blocks)
MIN_PIECE = 64             # shortest piece of tokens worth a program of the piece-map summary


@dataclass(frozen=True)
class KLAConfig:
    """Launch shape: channels per program, tokens per checkpoint chunk, warps per program, and the
    software-pipelining depth (``num_stages``) and unroll factor of the time loops (``None``: left
    to the compiler), for the forward and the backward. ``pieces``/``bwd_pieces`` split the forward's
    and the backward's time axis into that many stretches run by separate programs
    (``kalmanscan.kernels.kla.split``, ``kalmanscan.kernels.kla.bwd``); ``None`` splits only
    when there are at most ``2 x SMs`` channel-block programs, into ``floor(4 x SMs / programs)``
    stretches; 1 walks all of time in one program per channel block."""

    block_m: int = 16
    chunk: int = 32
    num_warps: int = 2
    bwd_block_m: int = 8
    bwd_num_warps: int = 1
    stages: int = 5          # H200, B=8 L=2048 M=1024: 3 -> 5 stages took the forward 0.85-1.03 -> 0.69-0.83 ms
    bwd_stages: int = 6      # and forward+backward 2.99-3.05 -> 2.47-2.63 ms (docs/performance.md)
    unroll: int | None = None
    bwd_unroll: int | None = None
    pieces: int | None = None
    bwd_pieces: int | None = None


DEFAULT_CONFIG = KLAConfig()


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor, initial_state: FilterState | None = None,
             config: KLAConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, FilterState]:
    """``(y, y_var, state)``: the signature every KLA backend shares (:func:`kla_scan_triton` with
    ``initial_state`` a pair ``(lam, eta)`` or ``None``, the state a :class:`FilterState`)."""
    lam0, eta0 = (None, None) if initial_state is None else initial_state
    y, y_var, lam, eta = kla_scan_triton(v, lam_v, k, q, decay, noise, lam0, eta0, config)
    return y, y_var, FilterState.from_information(lam, eta)


def kla_scan_triton(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                    noise: torch.Tensor,
                    lam0: torch.Tensor | None = None, eta0: torch.Tensor | None = None,
                    config: KLAConfig | None = None) -> tuple[torch.Tensor, ...]:
    """Fused KLA scan; returns ``(y, y_var, lam, eta)`` (shapes as :func:`kalmanscan.ops.kla.kla_scan`).

    Differentiable with respect to every tensor argument. ``config`` (a :class:`KLAConfig`)
    overrides the launch shape; results do not depend on it beyond float32 rounding.
    """
    config = config or DEFAULT_CONFIG
    if _largest_buffer(config, *v.shape, next_power_of_2(k.shape[-1]), v.device) >= 2**31:
        raise ValueError(f"v of shape {tuple(v.shape)} is too large for the kernels' int32 offsets")
    tensors = (v, lam_v, k, q, decay, noise, lam0, eta0)
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    return _KLAScan.apply(*tensors, config, save)


def _grid_args(B, M, S, block_m):
    n_mblocks = cdiv(M, block_m)
    return (B, n_mblocks), n_mblocks, next_power_of_2(S)


def _largest_buffer(config, B, L, M, S, device):
    """Elements in the largest tensor a kernel indexes (the kernels use int32 offsets)."""
    n_mblocks = cdiv(M, config.bwd_block_m)
    fwd_pieces = _pieces(config.pieces, config.block_m, config.chunk, B, L, M, device)[0]
    bwd_pieces = _pieces(config.bwd_pieces, config.bwd_block_m, config.chunk, B, L, M, device)[0]
    return max(B * L * M, B * L * n_mblocks * S, B * (cdiv(L, config.chunk) + 1) * M * S,
               B * max(7 * fwd_pieces, 5 * bwd_pieces) * M * S,
               B * n_mblocks * bwd_pieces * config.chunk * config.bwd_block_m * S)


def _pieces(requested, block_m, chunk, B, L, M, device):
    """``(n_pieces, piece_len)``: stretches of time, each a whole number of chunks (``KLAConfig``)."""
    n = requested
    if n is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        n = 4 * sms // (B * cdiv(M, block_m))
    n = max(1, min(n, cdiv(L, chunk)))
    piece_len = max(cdiv(cdiv(L, n), chunk), 1) * chunk
    return max(cdiv(L, piece_len), 1), piece_len


class _KLAScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, lam_v, k, q, decay, noise, lam0, eta0, config, save):
        v, lam_v, k, q = (x.contiguous() for x in (v, lam_v, k, q))
        decay32 = decay.detach().to(torch.float32).contiguous()
        noise32 = noise.detach().to(torch.float32).contiguous()
        B, L, M = v.shape
        S = k.shape[-1]
        has_init = lam0 is not None
        state0 = [x.detach().to(torch.float32).contiguous() if has_init else decay32
                  for x in (lam0, eta0)]
        dev = v.device
        chunk = config.chunk
        n_chunks = max(cdiv(L, chunk), 1)
        y = torch.empty(B, L, M, dtype=v.dtype, device=dev)
        y_var = torch.empty_like(y)
        lam = torch.empty(B, M, S, dtype=torch.float32, device=dev)
        eta = torch.empty_like(lam)
        ckpt = [torch.empty((B, n_chunks, M, S) if save else (1,), dtype=torch.float32, device=dev)
                for _ in range(2)]
        grid, n_mblocks, block_s = _grid_args(B, M, S, config.block_m)
        n_pieces, piece_len = _pieces(config.pieces, config.block_m, chunk, B, L, M, dev)
        maps = decay32
        if n_pieces > 1:
            maps = torch.empty(B, n_pieces, 7, M, S, dtype=torch.float32, device=dev)
            kla_piece_map_kernel[(B, n_mblocks, n_pieces - 1)](
                v, lam_v, k, q, decay32, noise32, maps, L, M, S, piece_len, n_pieces,
                BLOCK_M=config.block_m, BLOCK_S=block_s, STAGES=config.stages,
                num_warps=config.num_warps,
            )
        kla_fwd_kernel[grid + (n_pieces,)](
            v, lam_v, k, q, decay32, noise32, state0[0], state0[1], maps,
            y, y_var, lam, eta, ckpt[0], ckpt[1],
            L, M, S, n_chunks, piece_len, n_pieces,
            CHUNK=chunk, BLOCK_M=config.block_m, BLOCK_S=block_s,
            HAS_INIT=has_init, SAVE=save, STAGES=config.stages, UNROLL=config.unroll,
            num_warps=config.num_warps,
        )
        if save:
            ctx.save_for_backward(v, lam_v, k, q, decay32, noise32, ckpt[0], ckpt[1])
            ctx.meta = (config, n_chunks, decay.dtype, noise.dtype,
                        *(None if x is None else x.dtype for x in (lam0, eta0)))
        return y, y_var, lam, eta

    @staticmethod
    def backward(ctx, gy, gy_var, glam, geta):
        v, lam_v, k, q, decay32, noise32, ckpt_lam, ckpt_eta = ctx.saved_tensors
        config, n_chunks, decay_dtype, noise_dtype, lam0_dtype, eta0_dtype = ctx.meta
        B, L, M = v.shape
        S = k.shape[-1]
        dev = v.device
        gy, gy_var = gy.contiguous(), gy_var.contiguous()
        glam = glam.to(torch.float32).contiguous()
        geta = geta.to(torch.float32).contiguous()
        grid, n_mblocks, block_s = _grid_args(B, M, S, config.bwd_block_m)
        chunk = config.chunk
        n_pieces, piece_len = _pieces(config.bwd_pieces, config.bwd_block_m, chunk, B, L, M, dev)
        f32 = dict(dtype=torch.float32, device=dev)
        scratch = [torch.empty(B * n_mblocks * n_pieces * chunk * config.bwd_block_m * block_s, **f32)
                   for _ in range(2)]
        maps = torch.empty(B, n_pieces, 5, M, S, **f32) if n_pieces > 1 else decay32
        gv = torch.empty(B, L, M, **f32)
        glam_v = torch.empty(B, L, M, **f32)
        gk_part = torch.empty(B, L, n_mblocks, S, **f32)
        gq_part = torch.empty(B, L, n_mblocks, S, **f32)
        gdecay_part = torch.empty(B, n_pieces, M, S, **f32)
        gnoise_part = torch.empty(B, n_pieces, M, S, **f32)
        glam0 = torch.empty(B, M, S, **f32)
        geta0 = torch.empty(B, M, S, **f32)

        def launch(pieces_grid, piece_offset, map_only):
            kla_bwd_kernel[grid + (pieces_grid,)](
                v, lam_v, k, q, decay32, noise32, ckpt_lam, ckpt_eta,
                gy, gy_var, glam, geta, scratch[0], scratch[1], maps,
                gv, glam_v, gk_part, gq_part, gdecay_part, gnoise_part, glam0, geta0,
                L, M, S, n_chunks, n_mblocks, piece_len, n_pieces, piece_offset,
                CHUNK=chunk, BLOCK_M=config.bwd_block_m, BLOCK_S=block_s, STAGES=config.bwd_stages,
                UNROLL=config.bwd_unroll, MAP=map_only, num_warps=config.bwd_num_warps,
            )

        if n_pieces > 1:
            launch(n_pieces - 1, 1, True)  # adjoint maps of stretches 1 .. n_pieces - 1
        launch(n_pieces, 0, False)
        grads = (
            gv.to(v.dtype), glam_v.to(lam_v.dtype),
            gk_part.sum(2).to(k.dtype), gq_part.sum(2).to(q.dtype),
            gdecay_part.sum((0, 1)).to(decay_dtype), gnoise_part.sum((0, 1)).to(noise_dtype),
            None if lam0_dtype is None else glam0.to(lam0_dtype),
            None if eta0_dtype is None else geta0.to(eta0_dtype),
        )
        return grads + (None, None)


def summary(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
            noise: torch.Tensor,
            dtype: torch.dtype, config: KLAConfig | None = None) -> tuple[torch.Tensor, ...]:
    """The product of every token's step (7 tensors ``(B, M, S)``, :mod:`kalmanscan.merged`) from
    the triton backend's piece-map kernel (float32, divided by the trace
    after every token; forward only), in ``dtype``.

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
    kla_piece_map_kernel[(B, n_mblocks, pieces)](
        *(x.contiguous() for x in (v, lam_v, k, q)),
        *(x.detach().to(torch.float32).contiguous() for x in (decay, noise)), maps,
        L, M, S, piece_len, pieces + 1, BLOCK_M=config.block_m, BLOCK_S=next_power_of_2(S),
        STAGES=config.stages, num_warps=config.num_warps)
    total = merged.total(merged.compose, maps[:, :pieces].unbind(2), 1)
    return tuple(x[:, 0].to(dtype) for x in total)
