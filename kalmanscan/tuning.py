"""Tuning knobs of the fast paths: one frozen :class:`Tuning`, read where it is used through
:func:`current`, changed for a block of code by :func:`tuned`.

    import kalmanscan as ks
    with ks.tuning.tuned(replay=False, small_work=0):   # this thread (or task) only
        ks.filter(y, theta=0.1, sigma=1.0, obs_var=0.5)

The values live in a :class:`contextvars.ContextVar`: a change holds for the ``with`` block in the
thread or asyncio task that made it, never for another thread, and is undone on leaving the block
(exceptions included). No knob changes a result, only where and how it is computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["Tuning", "current", "tuned", "DEFAULT"]


@dataclass(frozen=True)
class Tuning:
    """The knobs, each with the default measured best (``docs/performance.md``).

    Attributes:
        y_by_result: on a GPU, a ``y`` of at most this many elements is checked for ``inf`` from a
            result (:func:`kalmanscan.problem.checks.decide_y`) instead of by a reduction queued
            before the kernels: such a call's kernels take a few microseconds, less than the host
            spends queueing a reduction and its read (about 60 against 30 us on an H200's host).
        small_work: element-steps below which a compiled CPU loop runs on the calling thread alone
            (:func:`kalmanscan.ops.cpu_threads.run_loop`): waking the others costs more than it
            saves, and on a busy machine a thread barrier can wait a time slice.
        numpy_work: float64 element-steps up to which the cpu backend filters (and derives the
            Posterior's fields) with NumPy steps over every series at once instead of its compiled
            loops, with their operations and bits (:mod:`kalmanscan.ops.filter.cpu.small`): a
            process's first compiled call pays numba's start, some 0.4 s of CPU.
        replay: whether small triton forward calls are replayed from CUDA graphs
            (:mod:`kalmanscan.ops.filter.triton.replay`).
        replay_graphs: layouts whose graphs are kept (least recently used dropped).
        replay_after: eager calls of a layout before its capture.
        fit_graphs: whether L-BFGS on the GPU's triton backend replays its evaluations from a CUDA
            graph (:mod:`kalmanscan.estimation.graphed`); off, each evaluation launches its
            operations from Python.
    """

    y_by_result: int = 1 << 18
    small_work: int = 1 << 17
    numpy_work: int = 1 << 12
    replay: bool = True
    replay_graphs: int = 4
    replay_after: int = 2
    fit_graphs: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in (bool, "bool"):
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be True or False, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{f.name} must be an integer >= 0, got {value!r}")
        if self.replay_graphs < 1:
            raise ValueError(f"replay_graphs must be >= 1 (replay=False turns replay off), got {self.replay_graphs}")


DEFAULT = Tuning()
_CURRENT: ContextVar[Tuning] = ContextVar("kalmanscan_tuning", default=DEFAULT)


def current() -> Tuning:
    """The knobs in force in this thread or task."""
    return _CURRENT.get()


@contextlib.contextmanager
def tuned(**changes: int | bool) -> Iterator[Tuning]:
    """The knobs of :func:`current` with ``changes`` (names of :class:`Tuning`'s fields) for the
    ``with`` block, in this thread or task only; yields them. ``ValueError`` for an unknown name
    or a bad value."""
    names = [f.name for f in dataclasses.fields(Tuning)]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise ValueError(f"tuned: unknown knobs {unknown}; the knobs are {names}")
    knobs = dataclasses.replace(current(), **changes)
    token = _CURRENT.set(knobs)
    try:
        yield knobs
    finally:
        _CURRENT.reset(token)
