"""The compiled reverse recursion of the ``"cpu"`` backend's filter: the scalar adjoints of
:func:`kalmanscan.ops.filter.cpu.loops.filter_forward`, backwards in time (the layout, constants
and recursion are in :mod:`kalmanscan.ops.filter.cpu.loops`). Imported lazily, compiled on first
use and cached on disk like the forward.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kalmanscan.ops.cpu_threads import PARALLEL
from kalmanscan.ops.filter.cpu.loops import (G_A, G_M, G_Q, G_R, G_H, H, HALF, INIT_MEAN, INIT_VAR, MEAN, O_LL, O_MEAN,
                                             O_PMEAN, O_POMEAN, O_POVAR, O_PPREC, O_PREC, O_PVAR, O_VAR, OBS_VAR, ONE,
                                             DT, SIGMA, THETA, TWO, Y, ZERO, lanes, static_transitions, transition)


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def filter_backward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                    zc: np.ndarray,
                    var: np.ndarray, cots: tuple[np.ndarray, ...], cboff: np.ndarray, ctstride: np.ndarray,
                    ccstride: np.ndarray,
                    has: np.ndarray, grads: tuple[np.ndarray, ...], step: np.ndarray, gy: np.ndarray, ginit: np.ndarray,
                    k: np.ndarray, T: int, C: int, W: int, trans_step: bool) -> None:
    """The reverse recursion of the scalar adjoints of :func:`filter_forward`.

    ``zc``, ``var``: the forward's centred filtered mean and variance ``(B T C,)``. ``cots``: the
    cotangents of ``O_MEAN .. O_LL``, read through ``cboff, ctstride, ccstride`` like the inputs
    (an expanded cotangent, e.g. of a sum, is not materialised); placeholders where ``has`` is
    unset. Writes ``gy`` (``(B T C,)``, 0 where ``y`` is missing), ``ginit`` (``(2, B C)``:
    adjoints of ``init_mean`` and ``init_var``) and the adjoints of ``decay, noise, obs_var, h,
    mean`` (``grads``, order ``G_A .. G_M``): ``(B T C,)`` per step where ``step`` is set (the
    decay and noise ones 0 at ``t = 0``), else summed over time per series (in float64), ``(B C,)``.
    """
    y_, th_, si_, dt_, R_, m_, h_, im_, iv_ = ins
    c_mean, c_var, c_prec, c_pmean, c_pvar, c_pprec, c_pomean, c_povar, c_ll = cots
    h_mean, h_var, h_prec, h_pmean, h_pvar = has[O_MEAN], has[O_VAR], has[O_PREC], has[O_PMEAN], has[O_PVAR]
    h_pprec, h_pomean, h_povar, h_ll = has[O_PPREC], has[O_POMEAN], has[O_POVAR], has[O_LL]
    g_a, g_q, g_R, g_h, g_m = grads
    s_a, s_R, s_h, s_m = step[G_A], step[G_R], step[G_H], step[G_M]
    t_y, t_th, t_si, t_dt = tstride[Y], tstride[THETA], tstride[SIGMA], tstride[DT]
    t_R, t_m, t_h = tstride[OBS_VAR], tstride[MEAN], tstride[H]
    half, zero, one, two = k[HALF], k[ZERO], k[ONE], k[TWO]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        cb, _ = lanes(cboff, ccstride, s0, n, T, C)
        bz = np.zeros(n, k.dtype)
        bP = np.zeros(n, k.dtype)
        A, Q = static_transitions(th_, si_, dt_, base, n, trans_step, k)
        sums = np.zeros((5, n), np.float64)
        for t in range(T - 1, -1, -1):
            for j in range(n):
                o = obase[j] + t * C
                a = one
                if t > 0:
                    a, q = transition(th_, si_, dt_, base, j, t, t_th, t_si, t_dt, trans_step, A, Q, k)
                    zprev = zc[o - C]
                    Pprev = var[o - C]
                    zp = a * zprev
                    Pp = a * a * Pprev + q
                else:
                    zp = im_[base[INIT_MEAN, j]] - m_[base[MEAN, j]]
                    Pp = iv_[base[INIT_VAR, j]]
                R = R_[base[OBS_VAR, j] + t * t_R]
                h = h_[base[H, j] + t * t_h]
                m = m_[base[MEAN, j] + t * t_m]
                y = y_[base[Y, j] + t * t_y]
                S = h * h * Pp + R
                iS = one / S
                Pf = var[o]
                # adjoints of the filtered z_t, P_t: carried from t + 1 plus the outputs'
                bzt = bz[j]
                bPt = bP[j]
                bm = zero
                if h_mean:
                    g = c_mean[cb[O_MEAN, j] + t * ctstride[O_MEAN]]
                    bzt += g
                    bm += g
                if h_var:
                    bPt += c_var[cb[O_VAR, j] + t * ctstride[O_VAR]]
                if h_prec:
                    bPt -= c_prec[cb[O_PREC, j] + t * ctstride[O_PREC]] / Pf / Pf
                bS = zero
                bh = zero
                bR = zero
                by = zero
                bzp = bzt
                if math.isnan(y):
                    bPp = bPt
                else:
                    v = (y - h * m) - h * zp
                    K = Pp * h * iS
                    bK = bzt * v
                    bv = bzt * K
                    bPp = (bK * h + bPt * R) * iS
                    bh += bK * Pp * iS
                    bR += bPt * Pp * iS
                    bS -= (bK * K + bPt * Pf) * iS
                    if h_ll:
                        g = c_ll[cb[O_LL, j] + t * ctstride[O_LL]]
                        bS -= half * g * (one - v * v * iS) * iS
                        bv -= g * v * iS
                    # v = y - h m - h zp
                    by = bv
                    bh -= bv * (m + zp)
                    bm -= bv * h
                    bzp -= bv * h
                if h_povar:
                    bS += c_povar[cb[O_POVAR, j] + t * ctstride[O_POVAR]]
                if h_pmean:
                    g = c_pmean[cb[O_PMEAN, j] + t * ctstride[O_PMEAN]]
                    bzp += g
                    bm += g
                if h_pvar:
                    bPp += c_pvar[cb[O_PVAR, j] + t * ctstride[O_PVAR]]
                if h_pprec:
                    bPp -= c_pprec[cb[O_PPREC, j] + t * ctstride[O_PPREC]] / Pp / Pp
                if h_pomean:
                    g = c_pomean[cb[O_POMEAN, j] + t * ctstride[O_POMEAN]]
                    bh += g * (zp + m)
                    bzp += g * h
                    bm += g * h
                # S = h^2 Pp + R
                bh += two * bS * h * Pp
                bPp += bS * h * h
                bR += bS
                gy[o] = by
                if t > 0:
                    ba = bzp * zprev + two * bPp * a * Pprev
                    bz[j] = a * bzp
                    bP[j] = a * a * bPp
                    if s_a:
                        g_a[o] = ba
                        g_q[o] = bPp
                    else:
                        sums[G_A, j] += ba
                        sums[G_Q, j] += bPp
                else:
                    # z_0 = init_mean - m_0, P_0 = init_var
                    ginit[0, s0 + j] = bzp
                    ginit[1, s0 + j] = bPp
                    bm -= bzp
                    if s_a:
                        g_a[o] = zero
                        g_q[o] = zero
                if s_R:
                    g_R[o] = bR
                else:
                    sums[G_R, j] += bR
                if s_h:
                    g_h[o] = bh
                else:
                    sums[G_H, j] += bh
                if s_m:
                    g_m[o] = bm
                else:
                    sums[G_M, j] += bm
        for j in range(n):
            if not s_a:
                g_a[s0 + j] = sums[G_A, j]
                g_q[s0 + j] = sums[G_Q, j]
            if not s_R:
                g_R[s0 + j] = sums[G_R, j]
            if not s_h:
                g_h[s0 + j] = sums[G_H, j]
            if not s_m:
                g_m[s0 + j] = sums[G_M, j]
