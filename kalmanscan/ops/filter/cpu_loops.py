"""The compiled loops of the ``"cpu"`` backend (:mod:`kalmanscan.ops.filter.cpu`), in numba.

Imported lazily by :mod:`kalmanscan.ops.filter.cpu` on the first call, so ``import kalmanscan``
neither imports numba nor compiles anything; each loop compiles on its first call per dtype and
is cached on disk (``cache=True``), so later processes load it instead.

Layout. Every input is a 1-D array holding a tensor's elements from its first one on, read
through element offsets: series ``b`` (the flattened batch index), step ``t`` and channel ``c``
sit at ``boff[b, k] + t * tstride[k] + c * cstride[k]`` for input ``k`` (a stride is 0 along a
broadcast axis), so static and broadcast parameters are never copied. Outputs are contiguous
``(B, T, C)`` arrays. A task is a block of ``W`` consecutive series ``s = b C + c`` (its lanes);
tasks run in parallel (``prange``), each walking time sequentially with its lanes innermost:
the lanes' independent recursions overlap in the pipeline, and adjacent channels' outputs are
written contiguously.

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


# Only the prange loops become parallel: numba's other parfor conversions (array expressions,
# reductions, fusion) find nothing to do here but cost compile time.
_PARALLEL = dict(prange=True, comprehension=False, setitem=False, reduction=False, numpy=False, stencil=False,
                 fusion=False, inplace_binop=False)


def constants(dtype: np.dtype | type) -> np.ndarray:
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
def _lanes(boff, cstride, s0, n, T, C):
    """Per-lane element offsets of each input (``(k, n)``, at ``t = 0``) and of the outputs
    (``(n,)``) for the series ``s0 .. s0 + n - 1`` (series ``s = b C + c``)."""
    base = np.empty((boff.shape[1], n), np.int64)
    obase = np.empty(n, np.int64)
    for j in range(n):
        s = s0 + j
        b = s // C
        c = s - b * C
        for i in range(boff.shape[1]):
            base[i, j] = boff[b, i] + c * cstride[i]
        obase[j] = b * T * C + c
    return base, obase


@njit(parallel=_PARALLEL, cache=True, error_model="numpy")
def filter_forward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                   outs: tuple[np.ndarray, ...],
                   write: np.ndarray, k: np.ndarray, T: int, C: int, W: int, trans_step: bool,
                   static_var: bool) -> None:
    """The filter over every series; writes the outputs flagged in ``write`` (see module doc).

    ``ins``: 9 input arrays (order ``Y .. INIT_VAR``); ``outs``: 11 output arrays (``O_MEAN ..
    O_ZC``, the last the centred filtered mean the backward reads), each ``(B T C,)`` where
    ``write`` is set, else a placeholder. ``trans_step``: theta, sigma or dt vary along time (else
    decay and noise are computed once per series). ``static_var``: neither they nor ``obs_var, h``
    vary along time, so an observed step's variance terms are a function of the incoming variance
    alone and are reused while it repeats (the Riccati recursion reaches its fixed point in
    floating point): the same values, bit for bit, as recomputing them.
    """
    y_, th_, si_, dt_, R_, m_, h_, im_, iv_ = ins
    o_mean, o_var, o_prec, o_pmean, o_pvar, o_pprec, o_pomean, o_povar, o_ll, o_miss, o_zc = outs
    w_mean, w_var, w_prec, w_pmean, w_pvar = write[O_MEAN], write[O_VAR], write[O_PREC], write[O_PMEAN], write[O_PVAR]
    w_pprec, w_pomean, w_povar, w_ll = write[O_PPREC], write[O_POMEAN], write[O_POVAR], write[O_LL]
    w_miss, w_zc = write[O_MISS], write[O_ZC]
    t_y, t_th, t_si, t_dt = tstride[Y], tstride[THETA], tstride[SIGMA], tstride[DT]
    t_R, t_m, t_h = tstride[OBS_VAR], tstride[MEAN], tstride[H]
    half, log2pi, zero, one = k[HALF], k[LOG2PI], k[ZERO], k[ONE]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = _lanes(boff, cstride, s0, n, T, C)
        z = np.empty(n, k.dtype)
        P = np.empty(n, k.dtype)
        A = np.empty(n, k.dtype)
        Q = np.empty(n, k.dtype)
        # the variance terms of the last observed step, keyed by its incoming variance cP
        cP = np.full(n, np.nan, k.dtype)
        cPp = np.empty(n, k.dtype)
        cS = np.empty(n, k.dtype)
        cK = np.empty(n, k.dtype)
        cPf = np.empty(n, k.dtype)
        cL = np.empty(n, k.dtype)
        cIf = np.empty(n, k.dtype)
        cIp = np.empty(n, k.dtype)
        for j in range(n):
            z[j] = im_[base[INIT_MEAN, j]] - m_[base[MEAN, j]]
            P[j] = iv_[base[INIT_VAR, j]]
            if not trans_step:
                A[j], Q[j] = _discretize(th_[base[THETA, j]], si_[base[SIGMA, j]], dt_[base[DT, j]], k)
        for t in range(T):
            for j in range(n):
                o = obase[j] + t * C
                y = y_[base[Y, j] + t * t_y]
                h = h_[base[H, j] + t * t_h]
                m = m_[base[MEAN, j] + t * t_m]
                if t > 0:
                    if trans_step:
                        a, q = _discretize(th_[base[THETA, j] + t * t_th], si_[base[SIGMA, j] + t * t_si],
                                           dt_[base[DT, j] + t * t_dt], k)
                    else:
                        a = A[j]
                        q = Q[j]
                    zp = a * z[j]
                    hit = static_var and P[j] == cP[j] and not math.isnan(y)
                    if hit:
                        Pp = cPp[j]
                    else:
                        Pp = a * a * P[j] + q
                else:
                    zp = z[j]
                    Pp = P[j]
                    hit = False
                if hit:
                    S = cS[j]
                    K = cK[j]
                    Pf = cPf[j]
                    lS = cL[j]
                    iPf = cIf[j]
                    iPp = cIp[j]
                else:
                    R = R_[base[OBS_VAR, j] + t * t_R]
                    S = h * h * Pp + R
                    iPp = one / Pp
                    if math.isnan(y):
                        K = zero
                        Pf = Pp
                        lS = zero
                        iPf = iPp
                    else:
                        K = Pp * h / S
                        Pf = Pp * R / S
                        lS = log2pi + math.log(S)
                        iPf = one / Pf
                        if static_var and t > 0:
                            cP[j] = P[j]
                            cPp[j] = Pp
                            cS[j] = S
                            cK[j] = K
                            cPf[j] = Pf
                            cL[j] = lS
                            cIf[j] = iPf
                            cIp[j] = iPp
                if math.isnan(y):
                    zf = zp
                    ll = zero
                    miss = one
                else:
                    v = (y - h * m) - h * zp
                    zf = zp + K * v
                    ll = -half * (lS + v * v / S)
                    miss = zero
                z[j] = zf
                P[j] = Pf
                if w_mean:
                    o_mean[o] = zf + m
                if w_var:
                    o_var[o] = Pf
                if w_prec:
                    o_prec[o] = iPf
                if w_pmean:
                    o_pmean[o] = zp + m
                if w_pvar:
                    o_pvar[o] = Pp
                if w_pprec:
                    o_pprec[o] = iPp
                if w_pomean:
                    o_pomean[o] = h * (zp + m)
                if w_povar:
                    o_povar[o] = S
                if w_ll:
                    o_ll[o] = ll
                if w_miss:
                    o_miss[o] = miss
                if w_zc:
                    o_zc[o] = zf


@njit(parallel=_PARALLEL, cache=True, error_model="numpy")
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
        base, obase = _lanes(boff, cstride, s0, n, T, C)
        cb, _ = _lanes(cboff, ccstride, s0, n, T, C)
        bz = np.zeros(n, k.dtype)
        bP = np.zeros(n, k.dtype)
        A = np.empty(n, k.dtype)
        Q = np.empty(n, k.dtype)
        sums = np.zeros((5, n), np.float64)
        for j in range(n):
            if not trans_step:
                A[j], Q[j] = _discretize(th_[base[THETA, j]], si_[base[SIGMA, j]], dt_[base[DT, j]], k)
        for t in range(T - 1, -1, -1):
            for j in range(n):
                o = obase[j] + t * C
                a = one
                if t > 0:
                    if trans_step:
                        a, q = _discretize(th_[base[THETA, j] + t * t_th], si_[base[SIGMA, j] + t * t_si],
                                           dt_[base[DT, j] + t * t_dt], k)
                    else:
                        a = A[j]
                        q = Q[j]
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
                    bPt -= c_prec[cb[O_PREC, j] + t * ctstride[O_PREC]] / (Pf * Pf)
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
                    bPp -= c_pprec[cb[O_PPREC, j] + t * ctstride[O_PPREC]] / (Pp * Pp)
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


@njit(parallel=_PARALLEL, cache=True, error_model="numpy")
def rts_forward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                outs: tuple[np.ndarray, ...],
                k: np.ndarray, T: int, C: int, W: int) -> None:
    """The RTS smoother over every series, backwards in time; ``ins``: filtered ``mean, var,
    pred_mean, pred_var, decay, noise`` (order ``S_MEAN .. S_NOISE``); writes ``outs`` =
    smoothed ``(mean, var, precision)``, each ``(B T C,)``.

    ``mean_s_t = mean_t + J_t (mean_s_{t+1} - pred_mean_{t+1})`` (the OU mean cancels: it is the
    centred recursion of :mod:`kalmanscan.smooth` with the offsets added back) and ``var_s_t =
    J_t^2 var_s_{t+1} + var_t q_{t+1} / pred_var_{t+1}``, ``J_t = a_{t+1} var_t / pred_var_{t+1}``.
    """
    mean_, var_, pmean_, pvar_, decay_, noise_ = ins
    o_mean, o_var, o_prec = outs
    t_mean, t_var, t_pmean, t_pvar = tstride[S_MEAN], tstride[S_VAR], tstride[S_PMEAN], tstride[S_PVAR]
    t_decay, t_noise = tstride[S_DECAY], tstride[S_NOISE]
    one = k[ONE]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = _lanes(boff, cstride, s0, n, T, C)
        ms = np.empty(n, k.dtype)
        vs = np.empty(n, k.dtype)
        for t in range(T - 1, -1, -1):
            for j in range(n):
                o = obase[j] + t * C
                mu = mean_[base[S_MEAN, j] + t * t_mean]
                v = var_[base[S_VAR, j] + t * t_var]
                if t == T - 1:
                    ms[j] = mu
                    vs[j] = v
                else:
                    t1 = t + 1
                    a = decay_[base[S_DECAY, j] + t1 * t_decay]
                    q = noise_[base[S_NOISE, j] + t1 * t_noise]
                    pv = pvar_[base[S_PVAR, j] + t1 * t_pvar]
                    pm = pmean_[base[S_PMEAN, j] + t1 * t_pmean]
                    J = a * v / pv
                    ms[j] = mu + J * (ms[j] - pm)
                    vs[j] = J * J * vs[j] + v * q / pv
                o_mean[o] = ms[j]
                o_var[o] = vs[j]
                o_prec[o] = one / vs[j]


@njit(parallel=_PARALLEL, cache=True, error_model="numpy")
def rts_backward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                 mean_s: np.ndarray,
                 var_s: np.ndarray, cots: tuple[np.ndarray, ...], cboff: np.ndarray, ctstride: np.ndarray,
                 ccstride: np.ndarray,
                 has: np.ndarray, grads: tuple[np.ndarray, ...], step: np.ndarray, k: np.ndarray, T: int, C: int,
                 W: int) -> None:
    """The adjoints of :func:`rts_forward`, forwards in time. ``mean_s, var_s``: its outputs;
    ``cots``: cotangents of its three outputs, read through ``cboff, ctstride, ccstride``
    (placeholders where ``has`` is unset). Writes ``grads`` in the order of ``ins``: ``(B T C,)``
    arrays for ``mean, var, pred_mean, pred_var``; for ``decay, noise`` per step where ``step`` is
    set, else per-series sums ``(B C,)`` (accumulated in float64)."""
    mean_, var_, pmean_, pvar_, decay_, noise_ = ins
    c_mean, c_var, c_prec = cots
    h_mean, h_var, h_prec = has[0], has[1], has[2]
    g_mean, g_var, g_pmean, g_pvar, g_decay, g_noise = grads
    per_step = step[0]
    t_var, t_pmean, t_pvar = tstride[S_VAR], tstride[S_PMEAN], tstride[S_PVAR]
    t_decay, t_noise = tstride[S_DECAY], tstride[S_NOISE]
    zero, two = k[ZERO], k[TWO]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = _lanes(boff, cstride, s0, n, T, C)
        cb, _ = _lanes(cboff, ccstride, s0, n, T, C)
        cm = np.zeros(n, k.dtype)
        cv = np.zeros(n, k.dtype)
        sums = np.zeros((2, n), np.float64)
        for t in range(T):
            for j in range(n):
                o = obase[j] + t * C
                gm = cm[j]
                gv = cv[j]
                if h_mean:
                    gm += c_mean[cb[0, j] + t * ctstride[0]]
                if h_var:
                    gv += c_var[cb[1, j] + t * ctstride[1]]
                if h_prec:
                    gv -= c_prec[cb[2, j] + t * ctstride[2]] / (var_s[o] * var_s[o])
                g_mean[o] = gm
                if t == 0:
                    g_pmean[o] = zero
                    g_pvar[o] = zero
                    if per_step:
                        g_decay[o] = zero
                        g_noise[o] = zero
                if t == T - 1:
                    g_var[o] = gv
                    continue
                t1 = t + 1
                v = var_[base[S_VAR, j] + t * t_var]
                a = decay_[base[S_DECAY, j] + t1 * t_decay]
                q = noise_[base[S_NOISE, j] + t1 * t_noise]
                pv = pvar_[base[S_PVAR, j] + t1 * t_pvar]
                pm = pmean_[base[S_PMEAN, j] + t1 * t_pmean]
                ipv = k[ONE] / pv
                J = a * v * ipv
                bJ = gm * (mean_s[o + C] - pm) + two * gv * J * var_s[o + C]
                cm[j] = gm * J
                cv[j] = gv * J * J
                g_var[o] = (gv * q + bJ * a) * ipv
                g_pmean[o + C] = -gm * J
                g_pvar[o + C] = -(gv * v * q * ipv + bJ * J) * ipv
                if per_step:
                    g_decay[o + C] = bJ * v * ipv
                    g_noise[o + C] = gv * v * ipv
                else:
                    sums[0, j] += bJ * v * ipv
                    sums[1, j] += gv * v * ipv
        if not per_step:
            for j in range(n):
                g_decay[s0 + j] = sums[0, j]
                g_noise[s0 + j] = sums[1, j]
