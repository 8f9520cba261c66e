"""Small forward calls replayed from CUDA graphs: what a loop of small ``ks.filter`` calls on a
GPU runs once the same layout has come three times.

A small call's time is its host's, not its kernels': each Triton launch costs the host 20-50 us
(its arguments specialised one by one), the three launches of the forward and their allocations
more than the kernels of a small problem take on the device (docs/performance.md, "What limits
each operation"). :func:`forward` keeps, per *layout* (shapes, strides, dtypes and device of the
kernels' inputs, the fields asked for, the launch configuration), a CUDA graph of
:func:`kalmanscan.ops.filter.triton.filter_forward` over static copies of those inputs. A call
copies its inputs into them (one copy per distinct memory block: ``y``, and the parameter rows that
:mod:`kalmanscan.problem.prepare` moves to the device as one tensor), replays the graph and copies the
outputs out into new tensors (one copy per output block): the same kernels, launch options and
bits as the eager call, with a handful of launches instead of three Triton launches and their
allocations.

Nothing is captured while a CUDA graph is being captured or under ``torch.compile``, nor again
for a layout whose capture failed (it stays eager, with a warning). The capture itself (after one
warm-up launch on a side stream, as CUDA graphs require) waits for nothing on the host. At most
:attr:`~kalmanscan.tuning.Tuning.replay_graphs` layouts are kept (least recently used dropped),
each holding its static inputs, outputs and the kernels' scratch in its own memory pool; only the calls
:func:`~kalmanscan.ops.filter.triton.replayed` picks are replayed (small outputs, or few long
series of up to :data:`~kalmanscan.ops.filter.triton.REPLAY_ELEMENTS` elements, whose kept layout
holds ``y`` and its outputs: 176 MiB for ``2^22`` float32 steps with every field). ``replay=False``
(:func:`kalmanscan.tuning.tuned`) turns it off; :func:`clear` drops the kept graphs.
"""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Callable

import torch

from kalmanscan import tuning

__all__ = ["forward", "clear", "kept", "Blocks"]

_SEEN: collections.Counter = collections.Counter()
_SEEN_SIZE = 256
_LOCK = threading.Lock()
_KEPT: collections.OrderedDict = collections.OrderedDict()


def forward(run: Callable[[dict, torch.Tensor], dict], views: dict[str, torch.Tensor], init: torch.Tensor,
            key: tuple) -> dict[str, torch.Tensor] | None:
    """``run(views, init)`` (a forward launch returning ``{name: tensor}``) replayed from the
    graph kept for this layout, or ``None`` when the caller should launch eagerly: replay off, the
    first :attr:`~kalmanscan.tuning.Tuning.replay_after` calls of a layout, a stream being captured,
    or inputs that cannot be copied by memory block (a block of mixed dtypes, or much larger than what the inputs span).
    ``key`` names everything of the launch besides the inputs' layout (fields, configuration)."""
    y = views["y"]
    knobs = tuning.current()
    if not knobs.replay or not y.is_cuda or torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return None
    inputs = [*views.values(), init]
    storages = [x.untyped_storage() for x in inputs]
    blocks = [m.data_ptr() for m in storages]
    stream = torch.cuda.current_stream(y.device).cuda_stream  # a graph per stream: its copies are ordered
    layout = (key, y.device, stream, torch.is_inference_mode_enabled(), tuple(views),
              tuple(blocks.index(b) for b in blocks), *(_layout(x, m) for x, m in zip(inputs, storages)))
    with _LOCK:  # copy in, replay, copy out: one call's at a time on the host, in stream order
        return _forward(run, views, init, inputs, layout, knobs)


def clear() -> None:
    """Drop every kept graph and count (their GPU memory is freed once nothing else holds it)."""
    with _LOCK:
        _KEPT.clear()
        _SEEN.clear()


def kept() -> int:
    """How many layouts are kept (graphs, and layouts left eager)."""
    return len(_KEPT)


def _forward(run, views, init, inputs, layout, knobs):
    y = views["y"]
    if layout not in _KEPT:
        if len(_SEEN) >= _SEEN_SIZE:  # many layouts seen once or twice: start counting afresh
            _SEEN.clear()
        _SEEN[layout] += 1
        if _SEEN[layout] <= knobs.replay_after:
            return None
        try:
            with torch.cuda.device(y.device):
                graph = _Graph.capture(run, views, init)
        except RuntimeError as err:  # an operation a CUDA graph cannot hold: this layout stays eager
            warnings.warn(f"ks.filter: small calls of this layout launch eagerly ({err})", RuntimeWarning, stacklevel=4)
            graph = None
        del _SEEN[layout]
        if len(_KEPT) >= knobs.replay_graphs:
            _KEPT.popitem(last=False)
        _KEPT[layout] = graph
    _KEPT.move_to_end(layout)
    graph = _KEPT[layout]
    return graph(inputs) if graph is not None else None


def _layout(x: torch.Tensor, block: torch.UntypedStorage) -> tuple:
    """What a graph fixes of an input besides which inputs share a memory block: dtype, shape,
    strides, offset in its block (``block``) and the block's size."""
    return x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), block.nbytes()


class _Graph:
    """One layout's graph: static copies of the inputs' memory blocks, the captured launch, its
    outputs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, blocks: Blocks, names: list[str], outputs: Blocks):
        self.graph, self.blocks, self.names, self.outputs = graph, blocks, names, outputs

    @classmethod
    def capture(cls, run, views, init):
        blocks = Blocks([*views.values(), init])
        if blocks.too_large():
            return None
        static = blocks.static_views()
        s_views, s_init = dict(zip(views, static[:-1])), static[-1]
        stream, current = torch.cuda.Stream(init.device), torch.cuda.current_stream(init.device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                run(s_views, s_init)  # warm-up: every kernel specialised for the static inputs first
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = run(s_views, s_init)
                finally:
                    graph.capture_end()
        finally:
            current.wait_stream(stream)
        return cls(graph, blocks, list(out), Blocks(list(out.values())))

    def __call__(self, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        self.blocks.fill(inputs)
        self.graph.replay()
        return dict(zip(self.names, self.outputs.copied_views()))


class Blocks:
    """Tensors grouped by the memory block they view: one flat tensor per block (copied whole),
    each tensor an ``as_strided`` view of its block's flat tensor."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        order = {}
        for x in tensors:
            order.setdefault(x.untyped_storage().data_ptr(), len(order))
        self.which = [order[x.untyped_storage().data_ptr()] for x in tensors]
        firsts = {}
        for x, b in zip(tensors, self.which):
            firsts.setdefault(b, x)
        self.flat = [_flat(firsts[b]) for b in range(len(order))]
        self.static = None

    def too_large(self) -> bool:
        """Whether a block is of another dtype than a tensor viewing it, or much larger than the
        tensors' own elements (a small slice of a big tensor: copied by block, that is waste)."""
        for b, flat in enumerate(self.flat):
            members = [x for x, w in zip(self.tensors, self.which) if w == b]
            if any(x.dtype != flat.dtype for x in members):
                return True
            if flat.numel() > max(1 << 16, 2 * sum(_extent(x) for x in members)):
                return True
        return False

    def static_views(self) -> list[torch.Tensor]:
        """Fresh copies of the blocks, and every tensor as the same view of its block's copy; the
        tensors given are not referenced after (their memory is the caller's)."""
        self.static = [flat.clone() for flat in self.flat]
        views = self._views(self.static)
        self.flat, self.tensors = None, [_Shape(x) for x in self.tensors]
        return views

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy the blocks of ``tensors`` (the same layout as at capture) into the static copies."""
        seen = set()
        for x, b in zip(tensors, self.which):
            if b not in seen:
                seen.add(b)
                self.static[b].copy_(_flat(x))

    def copied_views(self) -> list[torch.Tensor]:
        """New tensors: the blocks copied, every tensor the same view of its block's copy."""
        return self._views([flat.clone() for flat in self.flat])

    def _views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [flats[b].as_strided(x.shape, x.stride(), x.storage_offset()) for x, b in zip(self.tensors, self.which)]


class _Shape:
    """A tensor's shape, strides and offset, without its memory."""

    def __init__(self, x: torch.Tensor):
        self.shape, self._stride, self._offset = tuple(x.shape), x.stride(), x.storage_offset()

    def stride(self) -> tuple[int, ...]:
        return self._stride

    def storage_offset(self) -> int:
        return self._offset


def _flat(x: torch.Tensor) -> torch.Tensor:
    """The whole memory block ``x`` views, as a flat tensor of ``x``'s dtype."""
    n = x.untyped_storage().nbytes() // x.element_size()
    return x.new_empty(0).set_(x.untyped_storage(), 0, (n,), (1,))


def _extent(x: torch.Tensor) -> int:
    """Elements of its block that ``x`` spans (1 + the largest offset it reaches)."""
    return 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if n > 0)
