"""The fields of a filter's Posterior that follow from its filtered mean and variance, on the CPU:
one compiled elementwise pass (:func:`derive_fields`, numba), parallel over series, with the
operations of the forward loops (:mod:`kalmanscan.ops.filter.cpu.loops`: the same ``discretize``,
``log`` and order of operations), so an element's value does not depend on where it sits in the
array. The formulas are those of :mod:`kalmanscan.inference.derived`; imported on first use.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kalmanscan.ops.cpu_threads import PARALLEL
from kalmanscan.ops.filter.cpu.loops import (DT, H, HALF, INIT_MEAN, INIT_VAR, LOG2PI, MEAN, OBS_VAR, ONE, SIGMA,
                                             THETA, Y, ZERO, lanes, static_transitions, transition)

__all__ = ["derive_fields", "F_MEAN", "F_VAR", "N_OUT"]

F_MEAN, F_VAR = 9, 10  # the filtered mean and variance after the filter loops' inputs
N_OUT = 8  # precision, pred_mean, pred_var, pred_precision, pred_obs_mean, pred_obs_var, logliks, missing


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def derive_fields(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                  outs: tuple[np.ndarray, ...], k: np.ndarray, T: int, C: int, W: int, trans_step: bool) -> None:
    """Write the :data:`N_OUT` fields, contiguous ``(B T C,)`` arrays, from ``ins``: the 9 inputs of
    the filter loops (their order) and the filtered mean and variance, laid out as there
    (:func:`kalmanscan.ops.filter.cpu.backend.layout`); blocks of ``W`` series per task."""
    y_, th_, si_, dt_, R_, m_, h_, im_, iv_, fm_, fv_ = ins
    t_y, t_th, t_si, t_dt = tstride[Y], tstride[THETA], tstride[SIGMA], tstride[DT]
    t_R, t_m, t_h, t_fm, t_fv = tstride[OBS_VAR], tstride[MEAN], tstride[H], tstride[F_MEAN], tstride[F_VAR]
    prec, pmean, pvar, pprec, omean, ovar, ll_, miss_ = outs
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        A, Q = static_transitions(th_, si_, dt_, base, n, trans_step, k)
        # each lane's last S, var and Pp with their logarithm and reciprocals: once the variance has
        # converged they repeat, and the values are reused (the same bits as recomputing them)
        last = np.full((7, n), np.nan, k.dtype)
        for t in range(T):
            for j in range(n):
                o = obase[j] + t * C
                y = y_[base[Y, j] + t * t_y]
                h = h_[base[H, j] + t * t_h]
                m = m_[base[MEAN, j] + t * t_m]
                R = R_[base[OBS_VAR, j] + t * t_R]
                if t == 0:
                    zp = im_[base[INIT_MEAN, j]] - m
                    Pp = iv_[base[INIT_VAR, j]]
                else:
                    a, q = transition(th_, si_, dt_, base, j, t, t_th, t_si, t_dt, trans_step, A, Q, k)
                    zp = a * (fm_[base[F_MEAN, j] + (t - 1) * t_fm] - m_[base[MEAN, j] + (t - 1) * t_m])
                    Pp = a * a * fv_[base[F_VAR, j] + (t - 1) * t_fv] + q
                S = h * h * Pp + R
                if S != last[0, j]:
                    last[0, j], last[1, j], last[2, j] = S, k[LOG2PI] + math.log(S), k[ONE] / S
                v_t = fv_[base[F_VAR, j] + t * t_fv]
                if v_t != last[3, j]:
                    last[3, j], last[4, j] = v_t, k[ONE] / v_t
                if Pp != last[5, j]:
                    last[5, j], last[6, j] = Pp, k[ONE] / Pp
                prec[o] = last[4, j]
                pmean[o] = zp + m
                pvar[o] = Pp
                pprec[o] = last[6, j]
                omean[o] = h * (zp + m)
                ovar[o] = S
                if math.isnan(y):
                    ll_[o] = k[ZERO]
                    miss_[o] = k[ONE]
                else:
                    v = (y - h * m) - h * zp
                    ll_[o] = -k[HALF] * (last[1, j] + v * v * last[2, j])
                    miss_[o] = k[ZERO]
