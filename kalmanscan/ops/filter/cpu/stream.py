"""The compiled step of :func:`kalmanscan.ops.filter.cpu.stream_step`: one step of ``N``
streamed series (:class:`kalmanscan.StreamFilter`'s update on a CPU), in numba.

The step is the forward loops' (:mod:`kalmanscan.ops.filter.cpu.loops`, covariance form centred
on the OU mean) with the stored transition ``(decay, noise)``: ``zp = a (mean_prev - m)``,
``Pp = a^2 P_prev + q``, ``S = h^2 Pp + R``, and for an observed ``y`` the innovation
``v = (y - h m) - h zp``, ``z = zp + (Pp h / S) v``, ``P = Pp R / S`` and the log-density
``-(log 2 pi + log S + v^2 / S) / 2``; a missing ``y`` keeps ``z = zp, P = Pp`` and scores 0.

Two passes, each a loop over the series that the compiler vectorises: :func:`stream_moments`
reads one ``(8, N)`` array of inputs and writes one ``(10, N)`` array of outputs (two arrays, so
that a run-time check of their overlap is all the vectoriser needs; with the inputs as separate
arrays, or outputs as two, it keeps to one series at a time), without branches (both cases
computed, then selected: the same values). The logarithm is not vectorised in a compiled loop
here (no vector math library): NumPy's ``log`` takes ``S`` between the passes, and
:func:`stream_logliks` completes the log-density.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kalmanscan.ops.filter.cpu.loops import HALF, LOG2PI, ONE, ZERO

INPUTS = ("y", "mean", "var", "decay", "noise", "obs_var", "level", "h")  # rows of stream_moments' inp


@njit(cache=True, error_model="numpy")
def stream_moments(inp: np.ndarray, out: np.ndarray, k: np.ndarray) -> None:
    """The step (module docstring) of ``N`` series from ``inp`` ``(8, N)``, rows :data:`INPUTS`
    (``y``; the filtered mean and variance before it; ``decay, noise, obs_var``, the OU mean
    ``level`` and ``h``), into ``out`` ``(10, N)``: ``mean, var, precision, pred_mean, pred_var,
    pred_precision, pred_obs_mean, pred_obs_var``, then ``v^2 / S`` (:func:`stream_logliks` turns it
    into the log-density) and ``missing``. ``k``: :func:`kalmanscan.ops.filter.cpu.loops.constants`."""
    one, zero = k[ONE], k[ZERO]
    for i in range(inp.shape[1]):
        yi, a, q, R, m, h = inp[0, i], inp[3, i], inp[4, i], inp[5, i], inp[6, i], inp[7, i]
        miss = not (yi == yi)
        zp = a * (inp[1, i] - m)
        Pp = a * a * inp[2, i] + q
        S = h * h * Pp + R
        iS = one / S
        iPp = one / Pp
        Po = Pp * (R * iS)  # a variance times a ratio: in range at any scale
        v = (yi - h * m) - h * zp
        zf = zp if miss else zp + (Pp * h * iS) * v
        out[0, i] = zf + m
        out[1, i] = Pp if miss else Po
        out[2, i] = iPp if miss else one / Po
        out[3, i] = zp + m
        out[4, i] = Pp
        out[5, i] = iPp
        out[6, i] = h * (zp + m)
        out[7, i] = S
        out[8, i] = v * v * iS
        out[9, i] = one if miss else zero


@njit(cache=True, error_model="numpy")
def stream_logliks(out: np.ndarray, log_s: np.ndarray, k: np.ndarray) -> None:
    """``out[8] <- -(log 2 pi + log S + v^2 / S) / 2`` where observed and 0 where missing, from
    :func:`stream_moments`' ``out`` and ``log_s = log(out[7])``."""
    zero, half, log2pi = k[ZERO], k[HALF], k[LOG2PI]
    for i in range(out.shape[1]):
        out[8, i] = zero if out[9, i] != zero else -half * ((log2pi + log_s[i]) + out[8, i])
