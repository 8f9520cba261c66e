"""Launch configuration of the toolkit filter's Triton kernels: one frozen object, passed down.

Every launch wrapper of :mod:`kalmanscan.ops.filter.triton` takes a :class:`FilterConfig`
(default :data:`DEFAULT_CONFIG`); tests and benchmarks build their own with
``dataclasses.replace(DEFAULT_CONFIG, ...)`` instead of changing module state. The defaults and
the measurements behind them are in docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kalmanscan.ops.launch import config_from_ints, config_ints

__all__ = ["FilterConfig", "DEFAULT_CONFIG"]


@dataclass(frozen=True)
class FilterConfig:
    """Stretches, lanes, tiles and compiler options of the filter kernels.

    Walks (many series): every (stretch of time, channel) lane walks its stretch.
        target_lanes: enough (stretch, channel) lanes to fill an H100 with one-warp programs.
        min_stretch: shortest stretch worth an aggregate pass.
        min_stretches: a split into fewer stretches than this is not worth its aggregate pass:
            time is walked in one stretch instead (at 131072 channels two stretches took the
            forward 0.737 ms against one stretch's 0.442).
        max_stretches: bound on the carry scan's length.
        stretch: forces the steps per stretch (``None``: planned from the shape; the tests use
            small values to cross many stretch boundaries on small problems; it also turns the
            time-parallel tiles off).
        block: lanes per program (one warp, 4 lanes per thread) when ``C >= 32``;
        small_c_block: lanes per program when ``C < 32`` (lanes are then mostly stretches).
        num_warps, num_stages: warps per walking program, software-pipelining depth (``None``:
            Triton's default).
        prefetch: forward walks load ``y`` four steps ahead (a register ring);
        posterior_prefetch: the same for the one-pass posterior walk (ten outputs: off, it won).
        unroll, bwd_unroll: unrolling of the forward and backward walks' time loops.
        carry_chunk, carry_warps: stretches per step of the carry scan, and its warps.
        walk_closed: complete stretches of series with static parameters take their aggregate in
            closed form (:mod:`kalmanscan.kernels.filter.walks_closed`), in chunks of
            ``closed_chunk`` steps, instead of composing their steps.
        agg_warps: warps per program of the forward walks' aggregate pass (its lanes spread over
            more threads than the output walk's: more loads in flight).
        wide_from: 64-bit offsets once ``4 B T C`` reaches this (bounds every array a walk indexes).
    Tiles (few long series): lanes along time.
        tile: steps per tile; tile_row: steps per row of a tile, composed in-thread before the
            scan over rows (a power of two dividing ``tile``); tile_warps: warps per tile program;
        tile_stretches: at most this many stretches of tiles per series (one carry chunk);
        tile_max_c: the time-parallel forward serves series of at most this many channels;
        tile_bwd: the backward runs on tiles too wherever the forward does.
        tile_closed: complete stretches of a series with static parameters take the closed form
            (:mod:`kalmanscan.kernels.filter.tiles_closed`) instead of composing their steps.
    """

    target_lanes: int = 1 << 18
    min_stretch: int = 64
    min_stretches: int = 3
    max_stretches: int = 16384
    stretch: int | None = None
    block: int = 128
    small_c_block: int = 32
    num_warps: int = 1
    num_stages: int | None = None
    prefetch: bool = True
    posterior_prefetch: bool = False
    unroll: int = 4
    bwd_unroll: int = 1
    carry_chunk: int = 1024
    carry_warps: int = 4
    walk_closed: bool = True
    closed_chunk: int = 16
    agg_warps: int = 2
    wide_from: int = 1 << 31
    tile: int = 1024
    tile_row: int = 8
    tile_warps: int = 4
    tile_stretches: int = 1024
    tile_max_c: int = 1
    tile_bwd: bool = True
    tile_closed: bool = True

    def __post_init__(self):
        for name in ("target_lanes", "min_stretch", "min_stretches", "max_stretches", "block", "small_c_block",
                     "num_warps", "unroll", "bwd_unroll", "carry_chunk", "carry_warps", "closed_chunk", "agg_warps",
                     "tile", "tile_row", "tile_warps", "tile_stretches", "tile_max_c"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.stretch is not None and (not isinstance(self.stretch, int) or self.stretch < 1):
            raise ValueError(f"stretch must be a positive integer or None, got {self.stretch!r}")
        if self.tile % self.tile_row:
            raise ValueError(f"tile_row must divide tile, got {self.tile_row} and {self.tile}")

    def as_ints(self) -> list[int]:
        """The fields as the integers the ``kalmanscan::filter_fused`` operators take
        (:mod:`kalmanscan.ops.filter.triton.library`; :func:`kalmanscan.ops.launch.config_ints`)."""
        return config_ints(self)

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> FilterConfig:
        """The inverse of :meth:`as_ints`."""
        return config_from_ints(cls, values)


DEFAULT_CONFIG = FilterConfig()
