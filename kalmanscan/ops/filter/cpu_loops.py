"""The compiled loops of the ``"cpu"`` backend (:mod:`kalmanscan.ops.filter.cpu`), in numba.

Imported lazily by :mod:`kalmanscan.ops.filter.cpu` on the first call, so ``import kalmanscan``
neither imports numba nor compiles anything; each loop compiles on its first call per dtype and
is cached on disk (``cache=True``), so later processes load it instead.

Layout. Every input is a 1-D array holding a tensor's elements from its first one on, read
through element offsets: series ``b`` (the flattened batch index), step ``t`` and channel ``c``
sit at ``boff[b, k] + t * tstride[k] + c * cstride[k]`` for input ``k`` (a stride is 0 along a
broadcast axis), so static and broadcast parameters are never copied. Outputs are contiguous
``(B, T, C)`` arrays. A task is one series ``b`` and a block of ``W`` adjacent channels; tasks
run in parallel (``prange``), each walking time sequentially with its channels innermost, so
every output row of a block is written contiguously.

Arithmetic is in the dtype of the arrays: ``consts`` holds the constants in that dtype (a Python
float literal would promote float32 to float64). The per-series sums of the backward (adjoints of
static parameters) accumulate in float64 whatever the dtype. Each series is computed by one
thread with the same operations whatever the block or thread count, so results do not depend on
``numba.set_num_threads``.

Model and recursion (covariance form, centred on the OU mean like the reference backend):
``zp = a z, Pp = a^2 P + q`` (no transition at ``t = 0``), ``S = h^2 Pp + R``, and for an observed
``y``: ``v = (y - h m) - h zp``, ``K = Pp h / S``, ``z = zp + K v``, ``P = Pp R / S`` (the Joseph
form ``(1 - K h)^2 Pp + K^2 R`` simplified: a product of positive numbers, nothing cancels).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

# Input order of the filter loops (columns of boff, entries of tstride, cstride).
Y, THETA, SIGMA, DT, OBS_VAR, MEAN, H, INIT_MEAN, INIT_VAR = range(9)
# Output order of the forward.
(O_MEAN, O_VAR, O_PREC, O_PMEAN, O_PVAR, O_PPREC, O_POMEAN, O_POVAR, O_LL, O_MISS, O_ZC) = range(11)
# Constants (consts[i]) in the compute dtype.
HALF, SIXTH, C24, TAYLOR, LOG2PI, ZERO, ONE, TWO = range(8)
# Cotangent order of the filter backward (the differentiable forward outputs).
N_COT = 9
# Adjoint order of the filter backward: per-step or per-series parameter adjoints.
G_A, G_Q, G_R, G_H, G_M = range(5)
# Smoother inputs.
S_MEAN, S_VAR, S_PMEAN, S_PVAR, S_DECAY, S_NOISE = range(6)


def constants(dtype):
    """The array ``consts`` of the loops in ``dtype``."""
    return np.array([0.5, 1.0 / 6.0, 24.0, 1e-4, math.log(2.0 * math.pi), 0.0, 1.0, 2.0], dtype=dtype)


@njit(inline="always")
def _discretize(theta, sigma, dt, k):
    """``(decay, noise)`` of :func:`kalmanscan.ou.discretize` (``method="ou"``), same operations."""
    x = theta * dt
    decay = math.exp(-x)
    x2 = x + x
    if x2 < k[TAYLOR]:
        phi = k[ONE] - x2 * (k[HALF] - x2 * (k[SIXTH] - x2 / k[C24]))
    else:
        phi = -math.expm1(-x2) / x2
    return decay, sigma * sigma * dt * phi


@njit(inline="always")
def _at(arrays, i, off, tstride, cstride, t, c):
    """Element ``(t, c)`` of input ``i`` of a series whose offsets are ``off``."""
    return arrays[i][off[i] + t * tstride[i] + c * cstride[i]]


@njit(parallel=True, cache=True)
def filter_forward(ins, boff, tstride, cstride, outs, write, k, T, C, W, trans_step):
    """The filter over every series; writes the outputs flagged in ``write`` (see module doc).

    ``ins``: 9 input arrays (order ``Y .. INIT_VAR``); ``outs``: 11 output arrays (``O_MEAN ..
    O_ZC``, the last the centred filtered mean the backward reads), each ``(B T C,)`` where
    ``write`` is set, else a placeholder. ``trans_step``: theta, sigma or dt vary along time (else
    decay and noise are computed once per series).
    """
    B = boff.shape[0]
    nblk = (C + W - 1) // W
    for task in prange(B * nblk):
        b = task // nblk
        c0 = (task - b * nblk) * W
        n = min(W, C - c0)
        ob = boff[b]
        z = np.empty(n, k.dtype)
        P = np.empty(n, k.dtype)
        A = np.empty(n, k.dtype)
        Q = np.empty(n, k.dtype)
        for j in range(n):
            c = c0 + j
            m0 = _at(ins, MEAN, ob, tstride, cstride, 0, c)
            z[j] = _at(ins, INIT_MEAN, ob, tstride, cstride, 0, c) - m0
            P[j] = _at(ins, INIT_VAR, ob, tstride, cstride, 0, c)
            if not trans_step:
                A[j], Q[j] = _discretize(_at(ins, THETA, ob, tstride, cstride, 0, c),
                                         _at(ins, SIGMA, ob, tstride, cstride, 0, c),
                                         _at(ins, DT, ob, tstride, cstride, 0, c), k)
        row = (b * T) * C + c0
        for t in range(T):
            for j in range(n):
                c = c0 + j
                o = row + j
                if t > 0:
                    if trans_step:
                        a, q = _discretize(_at(ins, THETA, ob, tstride, cstride, t, c),
                                           _at(ins, SIGMA, ob, tstride, cstride, t, c),
                                           _at(ins, DT, ob, tstride, cstride, t, c), k)
                    else:
                        a = A[j]
                        q = Q[j]
                    zp = a * z[j]
                    Pp = a * a * P[j] + q
                else:
                    zp = z[j]
                    Pp = P[j]
                R = _at(ins, OBS_VAR, ob, tstride, cstride, t, c)
                h = _at(ins, H, ob, tstride, cstride, t, c)
                m = _at(ins, MEAN, ob, tstride, cstride, t, c)
                y = _at(ins, Y, ob, tstride, cstride, t, c)
                S = h * h * Pp + R
                if math.isnan(y):
                    zf = zp
                    Pf = Pp
                    ll = k[ZERO]
                    miss = k[ONE]
                else:
                    v = (y - h * m) - h * zp
                    zf = zp + (Pp * h / S) * v
                    Pf = Pp * R / S
                    ll = -k[HALF] * (k[LOG2PI] + math.log(S) + v * v / S)
                    miss = k[ZERO]
                z[j] = zf
                P[j] = Pf
                if write[O_MEAN]:
                    outs[O_MEAN][o] = zf + m
                if write[O_VAR]:
                    outs[O_VAR][o] = Pf
                if write[O_PREC]:
                    outs[O_PREC][o] = k[ONE] / Pf
                if write[O_PMEAN]:
                    outs[O_PMEAN][o] = zp + m
                if write[O_PVAR]:
                    outs[O_PVAR][o] = Pp
                if write[O_PPREC]:
                    outs[O_PPREC][o] = k[ONE] / Pp
                if write[O_POMEAN]:
                    outs[O_POMEAN][o] = h * (zp + m)
                if write[O_POVAR]:
                    outs[O_POVAR][o] = S
                if write[O_LL]:
                    outs[O_LL][o] = ll
                if write[O_MISS]:
                    outs[O_MISS][o] = miss
                if write[O_ZC]:
                    outs[O_ZC][o] = zf
            row += C


@njit(parallel=True, cache=True)
def filter_backward(ins, boff, tstride, cstride, zc, var, cots, cboff, ctstride, ccstride, has, grads, step,
                    gy, ginit, k, T, C, W, trans_step):
    """The reverse recursion of the scalar adjoints of :func:`filter_forward`.

    ``zc``, ``var``: the forward's centred filtered mean and variance ``(B T C,)``. ``cots``: the
    cotangents of ``O_MEAN .. O_LL``, read through ``cboff, ctstride, ccstride`` like the inputs
    (an expanded cotangent, e.g. of a sum, is not materialised); placeholders where ``has`` is
    unset.
    Writes ``gy`` (``(B T C,)``, 0 where ``y`` is missing), ``ginit`` (``(2, B C)``: adjoints of
    ``init_mean`` and ``init_var``) and the adjoints of ``decay, noise, obs_var, h, mean``
    (``grads``, order ``G_A .. G_M``): ``(B T C,)`` per step where ``step`` is set (the decay and
    noise ones 0 at ``t = 0``), else summed over time per series (in float64), ``(B C,)``.
    """
    B = boff.shape[0]
    nblk = (C + W - 1) // W
    for task in prange(B * nblk):
        b = task // nblk
        c0 = (task - b * nblk) * W
        n = min(W, C - c0)
        ob = boff[b]
        cob = cboff[b]
        bz = np.zeros(n, k.dtype)
        bP = np.zeros(n, k.dtype)
        A = np.empty(n, k.dtype)
        Q = np.empty(n, k.dtype)
        sums = np.zeros((5, n), np.float64)
        for j in range(n):
            c = c0 + j
            if not trans_step:
                A[j], Q[j] = _discretize(_at(ins, THETA, ob, tstride, cstride, 0, c),
                                         _at(ins, SIGMA, ob, tstride, cstride, 0, c),
                                         _at(ins, DT, ob, tstride, cstride, 0, c), k)
        row = (b * T + T - 1) * C + c0
        for t in range(T - 1, -1, -1):
            for j in range(n):
                c = c0 + j
                o = row + j
                a = k[ONE]
                q = k[ZERO]
                if t > 0:
                    if trans_step:
                        a, q = _discretize(_at(ins, THETA, ob, tstride, cstride, t, c),
                                           _at(ins, SIGMA, ob, tstride, cstride, t, c),
                                           _at(ins, DT, ob, tstride, cstride, t, c), k)
                    else:
                        a = A[j]
                        q = Q[j]
                    zprev = zc[o - C]
                    Pprev = var[o - C]
                    zp = a * zprev
                    Pp = a * a * Pprev + q
                else:
                    zprev = (_at(ins, INIT_MEAN, ob, tstride, cstride, 0, c)
                             - _at(ins, MEAN, ob, tstride, cstride, 0, c))
                    Pprev = _at(ins, INIT_VAR, ob, tstride, cstride, 0, c)
                    zp = zprev
                    Pp = Pprev
                R = _at(ins, OBS_VAR, ob, tstride, cstride, t, c)
                h = _at(ins, H, ob, tstride, cstride, t, c)
                m = _at(ins, MEAN, ob, tstride, cstride, t, c)
                y = _at(ins, Y, ob, tstride, cstride, t, c)
                S = h * h * Pp + R
                Pf = var[o]
                # adjoints of the filtered state z_t, P_t: carried from t + 1 plus the outputs'
                bzt = bz[j]
                bPt = bP[j]
                bm = k[ZERO]
                if has[O_MEAN]:
                    bzt += _at(cots, O_MEAN, cob, ctstride, ccstride, t, c)
                    bm += _at(cots, O_MEAN, cob, ctstride, ccstride, t, c)
                if has[O_VAR]:
                    bPt += _at(cots, O_VAR, cob, ctstride, ccstride, t, c)
                if has[O_PREC]:
                    bPt -= _at(cots, O_PREC, cob, ctstride, ccstride, t, c) / (Pf * Pf)
                bS = k[ZERO]
                bh = k[ZERO]
                bR = k[ZERO]
                by = k[ZERO]
                if math.isnan(y):
                    bzp = bzt
                    bPp = bPt
                else:
                    v = (y - h * m) - h * zp
                    K = Pp * h / S
                    bzp = bzt
                    bK = bzt * v
                    bv = bzt * K
                    bPp = bK * h / S + bPt * R / S
                    bh += bK * Pp / S
                    bR += bPt * Pp / S
                    bS -= (bK * K + bPt * Pf) / S
                    if has[O_LL]:
                        g = _at(cots, O_LL, cob, ctstride, ccstride, t, c)
                        bS -= k[HALF] * g * (k[ONE] - v * v / S) / S
                        bv -= g * v / S
                    # v = y - h m - h zp
                    by = bv
                    bh -= bv * (m + zp)
                    bm -= bv * h
                    bzp -= bv * h
                if has[O_POVAR]:
                    bS += _at(cots, O_POVAR, cob, ctstride, ccstride, t, c)
                if has[O_PMEAN]:
                    bzp += _at(cots, O_PMEAN, cob, ctstride, ccstride, t, c)
                    bm += _at(cots, O_PMEAN, cob, ctstride, ccstride, t, c)
                if has[O_PVAR]:
                    bPp += _at(cots, O_PVAR, cob, ctstride, ccstride, t, c)
                if has[O_PPREC]:
                    bPp -= _at(cots, O_PPREC, cob, ctstride, ccstride, t, c) / (Pp * Pp)
                if has[O_POMEAN]:
                    g = _at(cots, O_POMEAN, cob, ctstride, ccstride, t, c)
                    bh += g * (zp + m)
                    bzp += g * h
                    bm += g * h
                # S = h^2 Pp + R
                bh += k[TWO] * bS * h * Pp
                bPp += bS * h * h
                bR += bS
                gy[o] = by
                if t > 0:
                    ba = bzp * zprev + k[TWO] * bPp * a * Pprev
                    bz[j] = a * bzp
                    bP[j] = a * a * bPp
                    if step[G_A]:
                        grads[G_A][o] = ba
                        grads[G_Q][o] = bPp
                    else:
                        sums[G_A, j] += ba
                        sums[G_Q, j] += bPp
                else:
                    # z_0 = init_mean - m_0, P_0 = init_var
                    ginit[0, b * C + c] = bzp
                    ginit[1, b * C + c] = bPp
                    bm -= bzp
                    if step[G_A]:
                        grads[G_A][o] = k[ZERO]
                        grads[G_Q][o] = k[ZERO]
                if step[G_R]:
                    grads[G_R][o] = bR
                else:
                    sums[G_R, j] += bR
                if step[G_H]:
                    grads[G_H][o] = bh
                else:
                    sums[G_H, j] += bh
                if step[G_M]:
                    grads[G_M][o] = bm
                else:
                    sums[G_M, j] += bm
            row -= C
        for g in range(5):
            if not step[g]:
                for j in range(n):
                    grads[g][b * C + c0 + j] = sums[g, j]


@njit(parallel=True, cache=True)
def rts_forward(ins, boff, tstride, cstride, outs, k, T, C, W):
    """The RTS smoother over every series, backwards in time; ``ins``: filtered ``mean, var,
    pred_mean, pred_var, decay, noise`` (order ``S_MEAN .. S_NOISE``); writes ``outs`` =
    smoothed ``(mean, var, precision)``, each ``(B T C,)``.

    ``mean_s_t = mean_t + J_t (mean_s_{t+1} - pred_mean_{t+1})`` (the OU mean cancels: it is the
    centred recursion of :mod:`kalmanscan.smooth` with the offsets added back) and ``var_s_t =
    J_t^2 var_s_{t+1} + var_t q_{t+1} / pred_var_{t+1}``, ``J_t = a_{t+1} var_t / pred_var_{t+1}``.
    """
    B = boff.shape[0]
    nblk = (C + W - 1) // W
    for task in prange(B * nblk):
        b = task // nblk
        c0 = (task - b * nblk) * W
        n = min(W, C - c0)
        ob = boff[b]
        ms = np.empty(n, k.dtype)
        vs = np.empty(n, k.dtype)
        row = (b * T + T - 1) * C + c0
        for t in range(T - 1, -1, -1):
            for j in range(n):
                c = c0 + j
                o = row + j
                mu = _at(ins, S_MEAN, ob, tstride, cstride, t, c)
                v = _at(ins, S_VAR, ob, tstride, cstride, t, c)
                if t == T - 1:
                    ms[j] = mu
                    vs[j] = v
                else:
                    t1 = t + 1
                    a = _at(ins, S_DECAY, ob, tstride, cstride, t1, c)
                    q = _at(ins, S_NOISE, ob, tstride, cstride, t1, c)
                    pv = _at(ins, S_PVAR, ob, tstride, cstride, t1, c)
                    pm = _at(ins, S_PMEAN, ob, tstride, cstride, t1, c)
                    J = a * v / pv
                    ms[j] = mu + J * (ms[j] - pm)
                    vs[j] = J * J * vs[j] + v * q / pv
                outs[0][o] = ms[j]
                outs[1][o] = vs[j]
                outs[2][o] = k[ONE] / vs[j]
            row -= C


@njit(parallel=True, cache=True)
def rts_backward(ins, boff, tstride, cstride, mean_s, var_s, cots, cboff, ctstride, ccstride, has, grads, step,
                 k, T, C, W):
    """The adjoints of :func:`rts_forward`, forwards in time. ``mean_s, var_s``: its outputs;
    ``cots``: cotangents of its three outputs (placeholders where ``has`` is unset). Writes
    ``grads`` in the order of ``ins``: ``(B T C,)`` arrays for ``mean, var, pred_mean,
    pred_var``; for ``decay, noise`` per step where ``step`` is set, else per-series sums
    ``(B C,)`` (accumulated in float64)."""
    B = boff.shape[0]
    nblk = (C + W - 1) // W
    for task in prange(B * nblk):
        b = task // nblk
        c0 = (task - b * nblk) * W
        n = min(W, C - c0)
        ob = boff[b]
        cob = cboff[b]
        cm = np.zeros(n, k.dtype)
        cv = np.zeros(n, k.dtype)
        sums = np.zeros((2, n), np.float64)
        row = (b * T) * C + c0
        for t in range(T):
            for j in range(n):
                c = c0 + j
                o = row + j
                gm = cm[j]
                gv = cv[j]
                if has[0]:
                    gm += _at(cots, 0, cob, ctstride, ccstride, t, c)
                if has[1]:
                    gv += _at(cots, 1, cob, ctstride, ccstride, t, c)
                if has[2]:
                    gv -= _at(cots, 2, cob, ctstride, ccstride, t, c) / (var_s[o] * var_s[o])
                grads[S_MEAN][o] = gm
                if t == 0:
                    grads[S_PMEAN][o] = k[ZERO]
                    grads[S_PVAR][o] = k[ZERO]
                    if step[0]:
                        grads[S_DECAY][o] = k[ZERO]
                        grads[S_NOISE][o] = k[ZERO]
                if t == T - 1:
                    grads[S_VAR][o] = gv
                    continue
                t1 = t + 1
                v = _at(ins, S_VAR, ob, tstride, cstride, t, c)
                a = _at(ins, S_DECAY, ob, tstride, cstride, t1, c)
                q = _at(ins, S_NOISE, ob, tstride, cstride, t1, c)
                pv = _at(ins, S_PVAR, ob, tstride, cstride, t1, c)
                pm = _at(ins, S_PMEAN, ob, tstride, cstride, t1, c)
                J = a * v / pv
                bJ = gm * (mean_s[o + C] - pm) + k[TWO] * gv * J * var_s[o + C]
                cm[j] = gm * J
                cv[j] = gv * J * J
                grads[S_VAR][o] = gv * q / pv + bJ * a / pv
                grads[S_PMEAN][o + C] = -gm * J
                grads[S_PVAR][o + C] = -(gv * v * q / pv + bJ * J) / pv
                if step[0]:
                    grads[S_DECAY][o + C] = bJ * v / pv
                    grads[S_NOISE][o + C] = gv * v / pv
                else:
                    sums[0, j] += bJ * v / pv
                    sums[1, j] += gv * v / pv
            row += C
        if not step[0]:
            for j in range(n):
                grads[S_DECAY][b * C + c0 + j] = sums[0, j]
                grads[S_NOISE][b * C + c0 + j] = sums[1, j]
