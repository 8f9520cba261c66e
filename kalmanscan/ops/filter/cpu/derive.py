"""The fields of a filter's Posterior that follow from its filtered mean and variance, on the CPU:
one compiled elementwise pass (:func:`derive_fields`, numba), parallel over series, with the
operations of the forward loops (:mod:`kalmanscan.ops.filter.cpu.loops`: the same ``discretize``,
``log`` and order of operations), so an element's value does not depend on where it sits in the
array. The formulas are those of :mod:`kalmanscan.inference.derived`; imported on first use.

A task whose lanes are adjacent in ``y``, the filtered moments and the outputs, with every
parameter static (the common case: ``y`` of shape ``(..., T, C)``, parameters per channel), runs
each step as loops over its lanes (:func:`derive_rows`), which the compiler vectorises. Its
logarithm and reciprocals are cached for even and odd steps apart (the converged variance repeats
with period 1 or 2, see :mod:`kalmanscan.ops.filter.cpu.loops`) and recomputed lane by lane only on
a step where some lane's argument changed. The same operations as the per-lane path, so the same
bits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kalmanscan.ops.cpu_threads import PARALLEL
from kalmanscan.ops.filter.cpu.loops import (DT, H, HALF, INIT_MEAN, INIT_VAR, LOG2PI, MEAN, OBS_VAR, ONE, SIGMA,
                                             THETA, Y, ZERO, contiguous, lanes, static_transitions,
                                             transition)

__all__ = ["derive_fields", "F_MEAN", "F_VAR", "N_OUT"]

# Per-lane cache of the terms that need a logarithm or a division (rows of ``last``): the step's
# S with log(2 pi) + log S and 1/S, the filtered variance with its reciprocal, the predicted
# variance with its reciprocal. Once the variance has converged they repeat, and the cached values
# are reused (the same bits as recomputing them).
L_S, L_LS, L_IS, L_V, L_IV, L_PP, L_IPP = range(7)

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
        if rows(base, obase, n, tstride):
            derive_rows(y_, fm_, fv_, base, obase, n, t_y, t_fm, t_fv, outs, C, T,
                        static_transitions(th_, si_, dt_, base, n, False, k), R_, m_, h_, im_, iv_, k)
            continue
        A, Q = static_transitions(th_, si_, dt_, base, n, trans_step, k)
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
                cache_terms(last, j, S, fv_[base[F_VAR, j] + t * t_fv], Pp, k)
                prec[o] = last[L_IV, j]
                pmean[o] = zp + m
                pvar[o] = Pp
                pprec[o] = last[L_IPP, j]
                omean[o] = h * (zp + m)
                ovar[o] = S
                if math.isnan(y):
                    ll_[o] = k[ZERO]
                    miss_[o] = k[ONE]
                else:
                    v = (y - h * m) - h * zp
                    ll_[o] = -k[HALF] * (last[L_LS, j] + v * v * last[L_IS, j])
                    miss_[o] = k[ZERO]


@njit(inline="always")
def cache_terms(last: np.ndarray, j: int, S: float, v: float, Pp: float, k: np.ndarray) -> None:
    """Lane ``j``'s cached ``log(2 pi) + log S, 1/S, 1/v, 1/Pp`` brought to the step's ``S``, filtered
    variance ``v`` and predicted variance ``Pp`` (recomputed where the argument changed)."""
    if S != last[L_S, j]:
        last[L_S, j], last[L_LS, j], last[L_IS, j] = S, k[LOG2PI] + math.log(S), k[ONE] / S
    if v != last[L_V, j]:
        last[L_V, j], last[L_IV, j] = v, k[ONE] / v
    if Pp != last[L_PP, j]:
        last[L_PP, j], last[L_IPP, j] = Pp, k[ONE] / Pp


@njit(inline="always")
def rows(base: np.ndarray, obase: np.ndarray, n: int, tstride: np.ndarray) -> bool:
    """Whether a task's ``n`` lanes run as :func:`derive_rows`: every parameter static, ``y`` and the
    filtered moments varying along time, and the lanes adjacent elements of each and of the outputs."""
    for i in (THETA, SIGMA, DT, OBS_VAR, MEAN, H):
        if tstride[i] != 0:
            return False
    if tstride[F_MEAN] == 0 or tstride[F_VAR] == 0 or not contiguous(base, obase, n, tstride[Y]):
        return False
    for j in range(n):
        if base[F_MEAN, j] != base[F_MEAN, 0] + j or base[F_VAR, j] != base[F_VAR, 0] + j:
            return False
    return True


@njit(inline="always")
def derive_rows(y_: np.ndarray, fm_: np.ndarray, fv_: np.ndarray, base: np.ndarray, obase: np.ndarray, n: int,
                t_y: int, t_fm: int, t_fv: int, outs: tuple[np.ndarray, ...], C: int, T: int,
                AQ: tuple[np.ndarray, np.ndarray], R_: np.ndarray, m_: np.ndarray, h_: np.ndarray, im_: np.ndarray,
                iv_: np.ndarray, k: np.ndarray) -> None:
    """The per-lane path's steps for a task that :func:`rows` admits, each as loops over the lanes
    (one store each). Offsets are unsigned, so the compiler sees contiguous rows and vectorises the
    loops (as :func:`kalmanscan.ops.filter.cpu.loops.steady_run`). ``parity[t % 2]`` caches step
    ``t``'s terms (:func:`cache_terms`), checked for all lanes at once."""
    prec, pmean, pvar, pprec, omean, ovar, ll_, miss_ = outs
    a, q = AQ
    R = np.empty(n, k.dtype)
    h = np.empty(n, k.dtype)
    m = np.empty(n, k.dtype)
    zp = np.empty(n, k.dtype)
    Pp = np.empty(n, k.dtype)
    S = np.empty(n, k.dtype)
    v = np.empty(n, k.dtype)
    parity = np.full((2, 7, n), np.nan, k.dtype)  # the cached terms of even and odd steps
    for j in range(n):
        R[j], h[j], m[j] = R_[base[OBS_VAR, j]], h_[base[H, j]], m_[base[MEAN, j]]
        zp[j] = im_[base[INIT_MEAN, j]] - m[j]
        Pp[j] = iv_[base[INIT_VAR, j]]
    u = np.uint64(n)
    mh, zero, one = -k[HALF], k[ZERO], k[ONE]
    y0, fm0, fv0, o0 = np.uint64(base[Y, 0]), np.uint64(base[F_MEAN, 0]), np.uint64(base[F_VAR, 0]), np.uint64(obase[0])
    for t in range(T):
        o = o0 + np.uint64(t * C)
        if t > 0:
            f = fm0 + np.uint64((t - 1) * t_fm)
            for j in range(u):
                zp[j] = a[j] * (fm_[f + j] - m[j])
            g = fv0 + np.uint64((t - 1) * t_fv)
            for j in range(u):
                Pp[j] = a[j] * a[j] * fv_[g + j] + q[j]
        for j in range(u):
            S[j] = h[j] * h[j] * Pp[j] + R[j]
        for j in range(u):
            pmean[o + j] = zp[j] + m[j]
        for j in range(u):
            pvar[o + j] = Pp[j]
        for j in range(u):
            omean[o + j] = h[j] * (zp[j] + m[j])
        for j in range(u):
            ovar[o + j] = S[j]
        g = fv0 + np.uint64(t * t_fv)
        c = parity[t & 1]
        bad = 0
        for j in range(u):
            bad += (S[j] != c[L_S, j]) + (fv_[g + j] != c[L_V, j]) + (Pp[j] != c[L_PP, j])
        if bad:
            for j in range(n):
                cache_terms(c, j, S[j], fv_[g + j], Pp[j], k)
        for j in range(u):
            prec[o + j] = c[L_IV, j]
        for j in range(u):
            pprec[o + j] = c[L_IPP, j]
        yt = y0 + np.uint64(t * t_y)
        for j in range(u):
            v[j] = (y_[yt + j] - h[j] * m[j]) - h[j] * zp[j]
        for j in range(u):
            ll_[o + j] = zero if y_[yt + j] != y_[yt + j] else mh * (c[L_LS, j] + v[j] * v[j] * c[L_IS, j])
        for j in range(u):
            miss_[o + j] = one if y_[yt + j] != y_[yt + j] else zero
