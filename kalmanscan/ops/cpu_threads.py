"""Running a compiled (numba) loop on numba's threads, or on the calling thread alone when the
work is too small to pay for waking the others, and the parallel options the loops compile with
(the ``"cpu"`` backends of both operations). Importing it imports neither numba nor torch's
compiler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kalmanscan import tuning

__all__ = ["run_loop", "PARALLEL"]

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
    import numba

    if work >= tuning.current().small_work and tasks > 1:
        return kernel(*args)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        return kernel(*args)
    finally:
        numba.set_num_threads(threads)
