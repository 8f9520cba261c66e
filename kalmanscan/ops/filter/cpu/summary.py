"""The compiled loop of the ``"cpu"`` backend's ``summary``: a stretch of filter steps as its
7-number merged-form product (:mod:`kalmanscan.model.merged`), composed step by step per series.

The step of index ``t`` is ``[[A, B, 0], [C, D, 0], [b C, b D, a]]`` with ``(A, B, C, D) = (1 + q
phi, a^2 phi, q, a^2)`` (``phi = h^2 / obs_var`` and ``b = h (y - h mean) / obs_var``, both 0
where ``y`` is missing; step 0 has no transition: ``a = 1, q = 0``). The running product is
multiplied by each step on the left and divided by the power of two below the trace of its 2x2
block (exact), as :func:`kalmanscan.model.merged.compose` does; entries of the 2x2 block stay
``>= 0`` so nothing cancels. Forward only (no gradient): the time-chunked dask path and
:mod:`kalmanscan.distributed` without gradients use it; the torch backend's is differentiable.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from kalmanscan.ops.cpu_threads import PARALLEL

__all__ = ["product"]


@numba.njit(parallel=PARALLEL, cache=True, nogil=True)
def product(decay: np.ndarray, noise: np.ndarray, phi: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out[:, c]`` = the product of the steps of series ``c`` (``(T, n)`` inputs, ``(7, n)`` out)."""
    T, n = phi.shape
    for c in numba.prange(n):
        A, B, C, D, E, F, G = 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0
        for t in range(T):
            a = decay[t, c] if t > 0 else 1.0
            q = noise[t, c] if t > 0 else 0.0
            p, bt = phi[t, c], b[t, c]
            a2 = a * a
            lA, lB, lC, lD = 1.0 + q * p, a2 * p, q, a2
            lE, lF = bt * lC, bt * lD
            nA = lA * A + lB * C
            nB = lA * B + lB * D
            nC = lC * A + lD * C
            nD = lC * B + lD * D
            nE = lE * A + lF * C + a * E
            nF = lE * B + lF * D + a * F
            nG = a * G
            shift = 1 - math.frexp(nA + nD)[1]
            A, B, C, D = math.ldexp(nA, shift), math.ldexp(nB, shift), math.ldexp(nC, shift), math.ldexp(nD, shift)
            E, F, G = math.ldexp(nE, shift), math.ldexp(nF, shift), math.ldexp(nG, shift)
        out[0, c], out[1, c], out[2, c], out[3, c] = A, B, C, D
        out[4, c], out[5, c], out[6, c] = E, F, G
