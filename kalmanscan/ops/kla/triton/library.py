"""The fused KLA kernels as ``torch.library`` operators, so ``torch.compile`` traces through a
call without a graph break and a training step around it can be captured in a CUDA graph.

    kalmanscan::kla_scan_fwd(v, lam_v, k, q, decay, noise, lam0?, eta0?, save, config, cu_seqlens?)
        -> (y, y_var, lam, eta, ckpt_lam, ckpt_eta)
    kalmanscan::kla_scan_bwd(v, lam_v, k, q, decay, noise, ckpt_lam, ckpt_eta,
                             gy, gy_var, glam, geta, config, lam0?, eta0?, cu_seqlens?)
        -> (gv, glam_v, gk, gq, gdecay, gnoise, glam0, geta0)

Each has a fake (meta) implementation giving its outputs' shapes and dtypes from its inputs'
(:func:`torch.library.register_fake`), and the forward has its autograd formula
(:func:`torch.library.register_autograd`): the backward operator, recomputing every chunk from the
checkpoints the forward saved. The implementations launch the Triton kernels on the inputs'
device (CUDA, or the CPU under ``TRITON_INTERPRET=1``); they read no value on the host, so neither
operator synchronises.

Shapes: ``v``, ``lam_v``, ``y``, ``y_var`` ``(B, L, M)``; ``k``, ``q`` ``(B, L, S)``; ``decay``,
``noise`` ``(M, S)``; ``lam0``, ``eta0``, ``lam``, ``eta`` ``(B, M, S)`` (``lam``, ``eta`` and the
per-filter gradients as views of the kernels' layout, strided ``(..., S, M)`` with
``config.states_first``: no copy for a state nobody reads); the checkpoints
``(B, ceil(L / chunk), M, S)`` (``(..., S, M)`` with ``config.states_first``, the kernels' layout)
when ``save`` (the state at each chunk's start), else a ``(1,)`` zero.
``y``, ``y_var`` come in ``v``'s dtype and the gradients ``gv``, ``glam_v`` in ``v``'s and ``lam_v``'s,
everything else in float32 (the kernels' arithmetic): a half-precision ``v`` gets ``y`` and ``gv``
rounded once, as a cast after the scan would round them (though a 2-byte load a lane is not
pipelined: docs/decisions.md, "The KLA scan"); with
``config.variance`` false the kernels leave ``y_var`` out (a ``(1,)`` zero in its place, whose
gradient is not read), which saves its arithmetic and its traffic in both directions; the
autograd formula casts each gradient to its input's dtype. ``config`` is a :class:`KLAConfig`
as a list of ints (:meth:`KLAConfig.as_ints`, ``None`` fields as -1).

Packed documents (``cu_seqlens``, int32 ``(N + 1,)``, :mod:`kalmanscan.ops.kla.documents`):
``B = 1``; ``lam0``, ``eta0``, ``lam``, ``eta``, ``glam``, ``geta``, ``glam0``, ``geta0`` have one
row per document, ``(N, M, S)``; the kernels read the per-token ``starts``/``ends`` built from the
offsets on the device. An empty document's final state is its initial state (``lam = 1, eta = 0``
without one), and its initial state's gradients are its final state's cotangents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kalmanscan.kernels.kla.adjoint_map import kla_adjoint_map_kernel
from kalmanscan.kernels.kla.bwd import kla_bwd_kernel
from kalmanscan.kernels.kla.fwd import kla_fwd_kernel
from kalmanscan.kernels.kla.split import kla_piece_map_kernel

from kalmanscan.ops.kla.documents import boundaries, nonempty
from kalmanscan.ops.launch import cdiv, config_from_ints, config_ints, next_power_of_2

__all__ = ["kla_scan_fwd", "kla_scan_bwd", "forward", "KLAConfig", "DEFAULT_CONFIG", "SPLIT_CONFIG", "launch_config",
           "pieces", "filled", "scratch_elements", "l2_policies"]


@dataclass(frozen=True)
class KLAConfig:
    """Launch shape: channels per program, tokens per checkpoint chunk, warps per program, and the
    software-pipelining depth (``num_stages``) and unroll factor of the time loops (``None``: left
    to the compiler), for the forward and the backward. ``pieces``/``bwd_pieces`` split the forward's
    and the backward's time axis into that many stretches run by separate programs
    (``kalmanscan.kernels.kla.split``, ``kalmanscan.kernels.kla.bwd``); ``None`` splits only
    when there are at most ``2 x SMs`` channel-block programs, into ``floor(8 x SMs / programs)``
    stretches (``4 x SMs`` before: at B=2 L=8192 M=1024 S=16 on an H200 twice the stretches took
    the forward 1.03 -> 0.86 ms); 1 walks all of time in one program per
    channel block. ``bwd_pieces=None`` splits the backward where the forward splits, into
    ``floor(bwd_per_sm x SMs / programs)`` stretches. ``states_first`` turns the
    programs' grid of filters to ``[BLOCK_S, BLOCK_M]`` (each thread one channel's states, the
    per-filter tensors laid out ``(S, M)``: :mod:`kalmanscan.kernels.kla.common`); results do not
    depend on it beyond float32 rounding. ``variance=False`` leaves ``y_var`` out (see the module
    docstring); every other output and gradient is unchanged. ``even=True`` drops the kernels'
    bounds masks where the blocks tile the filters exactly (:func:`filled`); off by default: alone
    the kernels ran 2-4% faster forward and backward without them, but a compiled training step at
    B=2, L=8192 ran 1.3 ms (6%) slower (H100 and H200, 32-token chunks; docs/decisions.md, "The KLA scan"), which
    is not understood; at 16-token chunks the step took the same time with and without them
    (19.10 against 19.15 ms, H100, one A/B). ``l2_hints`` gives the backward's loads and stores
    eviction priorities in L2 (:func:`l2_policies`); results do not depend on it."""

    block_m: int = 16
    # The backward recomputes each chunk into per-program scratch (CHUNK x bwd_block_m x S x 8 bytes)
    # and reads it back in reverse. At 32 tokens the resident programs' scratch (64 MB at B=2 L=8192
    # M=1024 S=16, SPLIT_CONFIG) exceeds the 50 MB L2; at 16 (32 MB) the compiled model's step took
    # 19.15-19.23 ms against 20.47-20.71 at B=2 T=8192, and 17.73 against 18.94 at B=8 T=2048
    # (H100; docs/decisions.md, "The KLA scan"); at 8, 20.3-22.0 at T=8192.
    chunk: int = 16
    num_warps: int = 2
    bwd_block_m: int = 8
    bwd_num_warps: int = 1
    stages: int = 5          # H200, B=8 L=2048 M=1024: 3 -> 5 stages took the forward 0.85-1.03 -> 0.69-0.83 ms
    bwd_stages: int = 6      # and forward+backward 2.99-3.05 -> 2.47-2.63 ms
    unroll: int | None = None
    bwd_unroll: int | None = None
    pieces: int | None = None
    bwd_pieces: int | None = None
    # One-warp backward programs per multiprocessor that bwd_pieces=None aims for. Each stretch after
    # the first adds a forward walk composing its adjoint map (kalmanscan.kernels.kla.adjoint_map).
    # H200, M=1024 S=16, this layout: B=2 L=8192 fwd+bwd 3.17 ms at 8 stretches against 3.28 at 4
    # and 5.07 unsplit; B=8 L=2048 2.41 unsplit, 2.71 at 2 stretches.
    bwd_per_sm: int = 16
    states_first: bool = False
    variance: bool = True
    even: bool = False
    # The backward's recompute scratch marked evict-last in L2, the data it reads or writes once
    # evict-first: at B=2 L=8192 (H100) its DRAM traffic 2.8 -> 2.1 GB a call, the kernel 1.30 ->
    # 1.24 ms, the compiled model's step 19.2-19.7 -> 18.8-18.9 ms; at B=8 L=2048 no change
    # (docs/decisions.md, "The KLA scan").
    l2_hints: bool = True

    def as_ints(self) -> list[int]:
        """The fields as the integers the operators take (:func:`kalmanscan.ops.launch.config_ints`)."""
        return config_ints(self)

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> KLAConfig:
        """The inverse of :meth:`as_ints`."""
        return config_from_ints(cls, values)


DEFAULT_CONFIG = KLAConfig()
# Where DEFAULT_CONFIG splits time (few sequences), each thread holds one channel's states: 36%
# fewer instructions, and the time split brings back the warps this layout loses. H200, B=2 L=8192
# M=1024 S=16: forward 0.687-0.693 ms against 0.846-0.857, forward+backward 2.58 against 3.00;
# at B=8 L=2048 (no split) it lost, 2.41 against 2.23 (docs/decisions.md, "The KLA scan";
# these kernels compile to the SASS that was timed there).
# Its backward holds 168 registers a thread (sm_90), so 12 one-warp programs fit on a
# multiprocessor: at 16 a multiprocessor the stretches ran in 1.3 waves. At 8 (one wave) the
# forward+backward took 2.61-2.63 ms against 3.04-3.06 at B=1 L=16384, B=2 L=8192 and B=4 L=4096
# (H200, M=1024 S=16, without y_var), and the compiled model's step at B=2 T=8192 1.4-1.9 ms less
# (H100; docs/decisions.md, "The KLA scan").
SPLIT_CONFIG = KLAConfig(block_m=32, num_warps=1, bwd_block_m=16, bwd_per_sm=8, states_first=True)

Tensor = torch.Tensor
Six = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
Eight = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


_WITHOUT_VARIANCE = {c: dataclasses.replace(c, variance=False) for c in (DEFAULT_CONFIG, SPLIT_CONFIG)}


def launch_config(B: int, L: int, M: int, device: torch.device, variance: bool = True) -> KLAConfig:
    """The launch shape for ``B`` sequences of ``L`` tokens and ``M`` channels on ``device``:
    :data:`SPLIT_CONFIG` where :data:`DEFAULT_CONFIG` would split time, else :data:`DEFAULT_CONFIG`;
    with ``variance=False`` the same without ``y_var``."""
    split = pieces(None, DEFAULT_CONFIG.block_m, DEFAULT_CONFIG.chunk, B, L, M, device)[0] > 1
    config = SPLIT_CONFIG if split else DEFAULT_CONFIG
    return config if variance else _WITHOUT_VARIANCE[config]


def l2_policies(cfg: KLAConfig) -> dict[str, str]:
    """The backward's eviction policies (:mod:`kalmanscan.kernels.kla.bwd`): ``KEEP`` for its
    scratch, ``STREAM`` for the data it reads or writes once; the caches' defaults without
    ``cfg.l2_hints``."""
    return dict(KEEP="evict_last", STREAM="evict_first") if cfg.l2_hints else dict(KEEP="", STREAM="")


def pieces(requested: int | None, block_m: int, chunk: int, B: int, L: int, M: int,
           device: torch.device, per_sm: int = 8) -> tuple[int, int]:
    """``(n_pieces, piece_len)``: stretches of time, each a whole number of chunks (``KLAConfig``;
    ``per_sm``: the programs per multiprocessor that ``requested=None`` aims for, 8 in the forward,
    ``bwd_per_sm`` in the backward)."""
    n = requested
    if n is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        programs = B * cdiv(M, block_m)
        n = per_sm * sms // programs if programs <= 2 * sms else 1
    n = max(1, min(n, cdiv(L, chunk)))
    piece_len = max(cdiv(cdiv(L, n), chunk), 1) * chunk
    return max(cdiv(L, piece_len), 1), piece_len


def scratch_elements(cfg: KLAConfig, B: int, M: int, block_s: int, n_pieces: int) -> int:
    """Elements of each of the backward's two recompute scratches (``lam`` and ``eta`` before every
    step of a chunk, ``CHUNK x bwd_block_m x block_s`` a program) over all its programs: ``B``
    sequences of ``M`` channels in blocks of ``cfg.bwd_block_m``, ``n_pieces`` stretches of time."""
    return B * cdiv(M, cfg.bwd_block_m) * n_pieces * cfg.chunk * cfg.bwd_block_m * block_s


def filled(M: int, S: int, block_m: int) -> bool:
    """Whether programs of ``block_m`` channels and ``next_power_of_2(S)`` states tile the ``(M, S)``
    filters exactly (no padding lanes): the kernels can then run without bounds masks (``EVEN``,
    with ``KLAConfig.even``)."""
    return M % block_m == 0 and S == next_power_of_2(S)


_CONFIGS: dict = {}


def _config(values: Sequence[int]) -> KLAConfig:
    """:meth:`KLAConfig.from_ints`, remembered per list of integers (a launch then pays a lookup)."""
    key = tuple(values)
    found = _CONFIGS.get(key)
    if found is None:
        found = KLAConfig.from_ints(key)
        if len(_CONFIGS) < 64:
            _CONFIGS[key] = found
    return found


def _boundaries(cu_seqlens, L, unread):
    """The kernels' per-token ``starts``, ``ends`` (:func:`kalmanscan.ops.kla.documents.boundaries`);
    without documents the tensor ``unread`` in their place (the kernels do not read it: no
    allocation), and an int32 placeholder for documents without tokens."""
    if cu_seqlens is None:
        return unread, unread
    if L == 0:
        placeholder = torch.empty(1, dtype=torch.int32, device=unread.device)
        return placeholder, placeholder
    return boundaries(cu_seqlens, L)


def _final_state(rows, grid, state0, cu_seqlens, device):
    """The forward's final-state outputs ``(lam, eta)``, ``(rows, *grid)`` float32: left for the
    kernel to write, except with packed documents, where they start as the initial state ``state0``
    (kernel layout; ``None``: ``lam = 1, eta = 0``): the kernel writes the rows of the documents
    with tokens, and an empty document's final state is its initial state."""
    f32 = dict(dtype=torch.float32, device=device)
    if cu_seqlens is None:
        return torch.empty(rows, *grid, **f32), torch.empty(rows, *grid, **f32)
    if state0 is None:
        return torch.ones(rows, *grid, **f32), torch.zeros(rows, *grid, **f32)
    return state0[0].clone(), state0[1].clone()


def _initial_state_grads(B, grid, glam, geta, cu_seqlens, device):
    """The backward's initial-state gradients ``(glam0, geta0)`` before its kernel: left for it to
    write, except with packed documents, where an empty document's rows are its final state's
    cotangents (its final state is its initial state) and the others' are zero until the kernel
    writes them at each document's first token."""
    if cu_seqlens is None:
        return (torch.empty(B, *grid, dtype=torch.float32, device=device) for _ in range(2))
    empty = (~nonempty(cu_seqlens)).view(-1, *(1 for _ in grid))
    return torch.where(empty, glam, 0.0), torch.where(empty, geta, 0.0)


def _n_chunks(L, chunk):
    return torch.sym_max((L + chunk - 1) // chunk, 1)


def _grid(M, S, cfg):
    """The shape of a per-filter block in the kernels' memory layout."""
    return (S, M) if cfg.states_first else (M, S)


def _to_kernels(x, cfg):
    """A per-filter ``(..., M, S)`` tensor as the kernels read it: float32, laid out as :func:`_grid`."""
    x = x.to(torch.float32)
    return (x.transpose(-1, -2) if cfg.states_first else x).contiguous()


def _parameter(x):
    """``decay`` or ``noise`` ``(M, S)`` as the kernels read it: float32, contiguous, in its own
    layout whatever ``states_first`` (:func:`kalmanscan.kernels.kla.common.kla_tile`)."""
    return x.to(torch.float32).contiguous()


def _as_filters(x, cfg):
    """A per-filter tensor in the kernels' layout as an ``(..., M, S)`` view, without a copy: with
    ``cfg.states_first`` strided as ``(..., S, M)`` (the final state and the per-filter gradients).
    A final state nobody reads costs no copy; read, ``1 / lam`` keeps the layout, and continuing
    from it hands the kernels their own layout back (:func:`_to_kernels` then copies nothing).
    Autograd hands a leaf's ``.grad`` over in the leaf's own layout, and a consumer compiled by
    Inductor reads the view in place."""
    return x.transpose(-1, -2) if cfg.states_first else x


def _fake_filters(v, shape, cfg):
    """The fake of a per-filter output of ``shape`` ``(..., M, S)``: a buffer in the kernels'
    layout (:func:`_grid`) as :func:`_as_filters` returns it."""
    *lead, M, S = shape
    return _as_filters(v.new_empty((*lead, *_grid(M, S, cfg)), dtype=torch.float32), cfg)


def forward(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
            noise: torch.Tensor, lam0: torch.Tensor | None, eta0: torch.Tensor | None, save: bool,
            config: list[int], cu_seqlens: torch.Tensor | None = None,
            placeholder: Callable[..., torch.Tensor] = torch.zeros) -> Six:
    """The fused forward (:mod:`kalmanscan.kernels.kla.fwd`); see the module docstring. The
    implementation of the operator :data:`kla_scan_fwd`, callable directly where no autograd and no
    tracing is needed (it skips the operator's dispatch; ``placeholder=torch.empty`` then leaves
    the unused ``(1,)`` outputs unfilled: no launch for them)."""
    cfg = _config(config)
    v, lam_v, k, q = (x.contiguous() for x in (v, lam_v, k, q))
    decay32, noise32 = (_parameter(x) for x in (decay, noise))
    B, L, M = v.shape
    S = k.shape[-1]
    grid = _grid(M, S, cfg)
    has_init = lam0 is not None
    state0 = [_to_kernels(x, cfg) if has_init else decay32 for x in (lam0, eta0)]
    dev = v.device
    n_chunks = max(cdiv(L, cfg.chunk), 1)
    rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    y = torch.empty(B, L, M, dtype=v.dtype, device=dev)
    y_var = torch.empty_like(y) if cfg.variance else placeholder(1, dtype=v.dtype, device=dev)
    lam, eta = _final_state(rows, grid, state0 if has_init else None, cu_seqlens, dev)
    ckpt = [torch.empty(B, n_chunks, *grid, dtype=torch.float32, device=dev) if save
            else placeholder(1, dtype=torch.float32, device=dev) for _ in range(2)]
    starts, ends = _boundaries(cu_seqlens, L, decay32)
    n_mblocks, block_s = cdiv(M, cfg.block_m), next_power_of_2(S)
    even = cfg.even and filled(M, S, cfg.block_m)
    n_pieces, piece_len = pieces(cfg.pieces, cfg.block_m, cfg.chunk, B, L, M, dev)
    maps = decay32
    if n_pieces > 1:
        maps = torch.empty(B, n_pieces, 7, *grid, dtype=torch.float32, device=dev)
        kla_piece_map_kernel[(B, n_mblocks, n_pieces - 1)](
            v, lam_v, k, q, decay32, noise32, maps, state0[0], state0[1], starts,
            L, M, S, piece_len, n_pieces,
            BLOCK_M=cfg.block_m, BLOCK_S=block_s, STAGES=cfg.stages, STATES_FIRST=cfg.states_first,
            EVEN=even, HAS_INIT=has_init, VARLEN=cu_seqlens is not None, num_warps=cfg.num_warps,
        )
    kla_fwd_kernel[(B, n_mblocks, n_pieces)](
        v, lam_v, k, q, decay32, noise32, state0[0], state0[1], maps,
        y, y_var, lam, eta, ckpt[0], ckpt[1], starts, ends,
        L, M, S, n_chunks, piece_len, n_pieces,
        CHUNK=cfg.chunk, BLOCK_M=cfg.block_m, BLOCK_S=block_s,
        HAS_INIT=has_init, SAVE=save, STAGES=cfg.stages, UNROLL=cfg.unroll,
        STATES_FIRST=cfg.states_first, VAR=cfg.variance, EVEN=even, VARLEN=cu_seqlens is not None,
        num_warps=cfg.num_warps,
    )
    return y, y_var, _as_filters(lam, cfg), _as_filters(eta, cfg), ckpt[0], ckpt[1]


@torch.library.custom_op("kalmanscan::kla_scan_fwd", mutates_args=())
def kla_scan_fwd(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                 noise: torch.Tensor, lam0: torch.Tensor | None, eta0: torch.Tensor | None, save: bool,
                 config: list[int], cu_seqlens: torch.Tensor | None = None) -> Six:
    """The operator of :func:`forward` (its placeholders zero-filled: every output is defined)."""
    return forward(v, lam_v, k, q, decay, noise, lam0, eta0, save, config, cu_seqlens)


@kla_scan_fwd.register_fake
def _(v, lam_v, k, q, decay, noise, lam0, eta0, save, config, cu_seqlens=None):
    B, L, M = v.shape
    S = k.shape[-1]
    f32 = dict(dtype=torch.float32)
    cfg = _config(config)
    rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ckpt_shape = (B, _n_chunks(L, cfg.chunk), *_grid(M, S, cfg)) if save else (1,)
    y_var_shape = (B, L, M) if cfg.variance else (1,)
    return (v.new_empty(B, L, M), v.new_empty(y_var_shape), _fake_filters(v, (rows, M, S), cfg),
            _fake_filters(v, (rows, M, S), cfg), v.new_empty(ckpt_shape, **f32), v.new_empty(ckpt_shape, **f32))


@torch.library.custom_op("kalmanscan::kla_scan_bwd", mutates_args=())
def kla_scan_bwd(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                 noise: torch.Tensor, ckpt_lam: torch.Tensor, ckpt_eta: torch.Tensor, gy: torch.Tensor,
                 gy_var: torch.Tensor, glam: torch.Tensor, geta: torch.Tensor,
                 config: list[int], lam0: torch.Tensor | None = None, eta0: torch.Tensor | None = None,
                 cu_seqlens: torch.Tensor | None = None) -> Eight:
    """The fused backward (:mod:`kalmanscan.kernels.kla.bwd`): the gradients of the forward's eight
    tensor inputs from those of its first four outputs, ``gv`` and ``glam_v`` in ``v``'s and
    ``lam_v``'s dtypes (rounded once from float32 in the kernel), the others in float32; see the
    module docstring. Packed documents: the forward's ``cu_seqlens`` and initial state (read to
    recompute the documents' starts)."""
    cfg = _config(config)
    v, lam_v, k, q = (x.contiguous() for x in (v, lam_v, k, q))
    decay32, noise32 = (_parameter(x) for x in (decay, noise))
    B, L, M = v.shape
    S = k.shape[-1]
    grid = _grid(M, S, cfg)
    dev = v.device
    gy, gy_var = gy.contiguous(), gy_var.contiguous()
    glam, geta = (_to_kernels(x, cfg) for x in (glam, geta))
    n_mblocks, block_s = cdiv(M, cfg.bwd_block_m), next_power_of_2(S)
    even = cfg.even and filled(M, S, cfg.bwd_block_m)
    chunk = cfg.chunk
    n_chunks = max(cdiv(L, chunk), 1)
    n_pieces, piece_len = pieces(cfg.bwd_pieces, cfg.bwd_block_m, chunk, B, L, M, dev, cfg.bwd_per_sm)
    f32 = dict(dtype=torch.float32, device=dev)
    scratch = [torch.empty(scratch_elements(cfg, B, M, block_s, n_pieces), **f32) for _ in range(2)]
    maps = torch.empty(B, n_pieces, 5, *grid, **f32) if n_pieces > 1 else decay32
    gv = torch.empty(B, L, M, dtype=v.dtype, device=dev)
    glam_v = torch.empty(B, L, M, dtype=lam_v.dtype, device=dev)
    gk_part = torch.empty(B, L, n_mblocks, S, **f32)
    gq_part = torch.empty(B, L, n_mblocks, S, **f32)
    gdecay_part = torch.empty(B, n_pieces, *grid, **f32)
    gnoise_part = torch.empty(B, n_pieces, *grid, **f32)
    has_init = lam0 is not None
    glam0, geta0 = _initial_state_grads(B, grid, glam, geta, cu_seqlens, dev)
    state0 = [_to_kernels(x, cfg) if has_init else decay32 for x in (lam0, eta0)]
    starts, ends = _boundaries(cu_seqlens, L, decay32)
    varlen = cu_seqlens is not None

    if n_pieces > 1:  # the adjoint maps of stretches 1 .. n_pieces - 1
        kla_adjoint_map_kernel[(B, n_mblocks, n_pieces - 1)](
            v, lam_v, k, q, decay32, noise32, ckpt_lam, ckpt_eta, gy, gy_var, maps, glam, geta,
            state0[0], state0[1], starts, ends,
            L, M, S, n_chunks, piece_len, n_pieces,
            CHUNK=chunk, BLOCK_M=cfg.bwd_block_m, BLOCK_S=block_s, STAGES=cfg.bwd_stages,
            STATES_FIRST=cfg.states_first, VAR=cfg.variance, EVEN=even, HAS_INIT=has_init, VARLEN=varlen,
            num_warps=cfg.bwd_num_warps,
        )
    kla_bwd_kernel[(B, n_mblocks, n_pieces)](
        v, lam_v, k, q, decay32, noise32, ckpt_lam, ckpt_eta,
        gy, gy_var, glam, geta, scratch[0], scratch[1], maps,
        gv, glam_v, gk_part, gq_part, gdecay_part, gnoise_part, glam0, geta0, state0[0], state0[1], starts, ends,
        L, M, S, n_chunks, n_mblocks, piece_len, n_pieces,
        CHUNK=chunk, BLOCK_M=cfg.bwd_block_m, BLOCK_S=block_s, STAGES=cfg.bwd_stages,
        UNROLL=cfg.bwd_unroll, STATES_FIRST=cfg.states_first, VAR=cfg.variance, EVEN=even,
        **l2_policies(cfg), HAS_INIT=has_init, VARLEN=varlen, num_warps=cfg.bwd_num_warps,
    )
    return (gv, glam_v, gk_part.sum(2), gq_part.sum(2),
            *(_as_filters(x, cfg) for x in (gdecay_part.sum((0, 1)), gnoise_part.sum((0, 1)), glam0, geta0)))


@kla_scan_bwd.register_fake
def _(v, lam_v, k, q, decay, noise, ckpt_lam, ckpt_eta, gy, gy_var, glam, geta, config, lam0=None, eta0=None,
      cu_seqlens=None):
    B, L, M = v.shape
    S = k.shape[-1]
    cfg = _config(config)
    f32 = dict(dtype=torch.float32)
    rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (v.new_empty(B, L, M), lam_v.new_empty(B, L, M), v.new_empty(B, L, S, **f32),
            v.new_empty(B, L, S, **f32), _fake_filters(v, (M, S), cfg), _fake_filters(v, (M, S), cfg),
            _fake_filters(v, (rows, M, S), cfg), _fake_filters(v, (rows, M, S), cfg))


def _setup_context(ctx, inputs, output):
    v, lam_v, k, q, decay, noise, lam0, eta0, save, config, cu_seqlens = inputs
    ctx.save_for_backward(v, lam_v, k, q, decay, noise, output[4], output[5], lam0, eta0, cu_seqlens)
    ctx.save, ctx.config = save, config
    ctx.dtypes = [None if x is None else x.dtype for x in (v, lam_v, k, q, decay, noise, lam0, eta0)]


def _backward(ctx, gy, gy_var, glam, geta, _gckpt_lam, _gckpt_eta):
    if not ctx.save:
        raise RuntimeError("kla_scan_fwd ran with save=False: it kept no checkpoints for a backward")
    v, lam_v, k, q, decay, noise, ckpt_lam, ckpt_eta, lam0, eta0, cu_seqlens = ctx.saved_tensors
    grads = kla_scan_bwd(v, lam_v, k, q, decay, noise, ckpt_lam, ckpt_eta, gy, gy_var, glam, geta, ctx.config,
                         lam0, eta0, cu_seqlens)
    return tuple(None if dtype is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)) + (None, None, None)


torch.library.register_autograd("kalmanscan::kla_scan_fwd", _backward, setup_context=_setup_context)
