"""The compiled step of :func:`kalmanscan.ops.filter.cpu.stream_step`: one step of ``N``
streamed series (:class:`kalmanscan.StreamFilter`'s update on a CPU), in numba.

The step is the forward loops' (:mod:`kalmanscan.ops.filter.cpu_loops`, covariance form centred
on the OU mean) with the stored transition ``(decay, noise)``: ``zp = a (mean_prev - m)``,
``Pp = a^2 P_prev + q``, ``S = h^2 Pp + R``, and for an observed ``y`` the innovation
``v = (y - h m) - h zp``, ``z = zp + (Pp h / S) v``, ``P = Pp R / S`` and the log-density
``-(log 2 pi + log S + v^2 / S) / 2``; a missing ``y`` keeps ``z = zp, P = Pp`` and scores 0.
Written without branches (both cases computed, then selected: the same values) and over blocks
of :data:`LANES` series copied into local arrays, so the compiler vectorises the arithmetic
(outputs that may alias the inputs otherwise keep it to one series at a time: about 9x slower
here). One thread: a step of a few thousand series is too little work to wake the others.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .cpu_loops import HALF, LOG2PI, ONE, ZERO

LANES = 64            # series per block
N_ROWS = 10           # rows of out: kalmanscan.ops.filter.cpu.FIELDS


@njit(cache=True, error_model="numpy")
def stream_step(y: np.ndarray, state: np.ndarray, rows: np.ndarray, out: np.ndarray, new_state: np.ndarray,
                k: np.ndarray) -> None:
    """The step (module docstring) of ``y`` ``(N,)`` from the filtered ``state`` ``(2, N)`` (mean,
    variance) with ``rows`` ``(5, N)`` = ``decay, noise, obs_var, mean, h``: every row of ``out``
    ``(10, N)`` (``mean, var, precision, pred_mean, pred_var, pred_precision, pred_obs_mean,
    pred_obs_var, logliks, missing``) and the new ``(mean, variance)`` into ``new_state``."""
    N = y.shape[0]
    inp = np.empty((8, LANES), y.dtype)
    res = np.empty((N_ROWS, LANES), y.dtype)
    for i0 in range(0, N, LANES):
        n = min(LANES, N - i0)
        for j in range(LANES):  # a partial last block repeats its first series
            i = i0 + j if j < n else i0
            inp[0, j] = y[i]
            inp[1, j] = state[0, i]
            inp[2, j] = state[1, i]
            for r in range(5):
                inp[3 + r, j] = rows[r, i]
        for j in range(LANES):
            yi, a, q, R, m, h = inp[0, j], inp[3, j], inp[4, j], inp[5, j], inp[6, j], inp[7, j]
            miss = not (yi == yi)
            zp = a * (inp[1, j] - m)
            Pp = a * a * inp[2, j] + q
            S = h * h * Pp + R
            iS = k[ONE] / S
            iPp = k[ONE] / Pp
            Po = Pp * R * iS
            v = (yi - h * m) - h * zp
            zf = zp if miss else zp + (Pp * h * iS) * v
            res[0, j] = zf + m
            res[1, j] = Pp if miss else Po
            res[2, j] = iPp if miss else k[ONE] / Po
            res[3, j] = zp + m
            res[4, j] = Pp
            res[5, j] = iPp
            res[6, j] = h * (zp + m)
            res[7, j] = S
            res[8, j] = k[ZERO] if miss else -k[HALF] * ((k[LOG2PI] + math.log(S)) + v * v * iS)
            res[9, j] = k[ONE] if miss else k[ZERO]
        for r in range(N_ROWS):
            for j in range(n):
                out[r, i0 + j] = res[r, j]
        for j in range(n):
            new_state[0, i0 + j] = res[0, j]
            new_state[1, i0 + j] = res[1, j]
