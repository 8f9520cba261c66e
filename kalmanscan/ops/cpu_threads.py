"""Running a compiled (numba) loop on numba's threads, or on the calling thread alone when the
work is too small to pay for waking the others, and the parallel options the loops compile with
(the ``"cpu"`` backends of both operations). Importing it imports neither numba nor torch's
compiler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kalmanscan import tuning

__all__ = ["run_loop", "numba_threads", "numba_thread_count", "PARALLEL"]

# numba's ``parallel=`` option of the loops: only the prange loops become parallel; numba's other
# parfor conversions (array expressions, reductions, fusion) find nothing to do there but cost
# compile time.
PARALLEL = dict(prange=True, comprehension=False, setitem=False, reduction=False, numpy=False, stencil=False,
                fusion=False, inplace_binop=False)


def run_loop(kernel: Callable[..., Any], tasks: int, work: int, *args: Any) -> Any:
    """``kernel(*args)`` on numba's threads, or on this thread alone when ``work`` is below
    :attr:`kalmanscan.tuning.Tuning.small_work` or there is a single task. The loops compute each task with
    the same operations whatever the thread count, so the choice changes no result. Opaque to
    ``torch.compile`` (a graph break): Dynamo would otherwise trace into numba's dispatcher, which
    on a loop's first call (its compilation) it cannot. The opaque wrapper is made only under the
    compiler, so that eager calls never import it."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_run)(kernel, tasks, work, *args)
    return _run(kernel, tasks, work, *args)


def _run(kernel: Callable[..., Any], tasks: int, work: int, *args: Any) -> Any:
    parallel = work >= tuning.current().small_work and tasks > 1
    with numba_threads(None if parallel else 1):
        return kernel(*args)


def numba_thread_count() -> int:
    """``numba.get_num_threads()``, torch's intra-op thread count kept: numba's first call of it in
    a process starts its threading layer, which under OpenMP sets the runtime's count to numba's
    (a caller's ``torch.set_num_threads(1)`` would be undone). Opaque to ``torch.compile``, as
    :func:`run_loop` is (the count torch reads is part of a compiled graph's guards)."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_thread_count)()
    return _thread_count()


def _thread_count() -> int:
    with _torch_threads_kept():
        import numba

        return numba.get_num_threads()


@contextlib.contextmanager
def numba_threads(count: int | None) -> Iterator[None]:
    """numba's thread count set to ``count`` for the block (``None``: left as it is), then both
    numba's and torch's intra-op thread counts as they were. Under numba's OpenMP threading layer
    the two share one OpenMP runtime, where numba's ``set_num_threads`` also sets the count torch
    reads: a call would otherwise change the caller's ``torch.get_num_threads()`` (and with it
    every compiled graph's guards)."""
    with _torch_threads_kept():
        threads = _thread_count()  # (may start numba's threading layer)
        if count is None:
            yield
            return
        import numba

        numba.set_num_threads(count)
        try:
            yield
        finally:
            numba.set_num_threads(threads)


@contextlib.contextmanager
def _torch_threads_kept() -> Iterator[None]:
    """torch's intra-op thread count put back as it was after the block, where numba changed it."""
    torch_threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
