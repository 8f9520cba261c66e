"""The compiled RTS smoother of the ``"cpu"`` backend and its adjoint (the layout and constants
are in :mod:`kalmanscan.ops.filter.cpu.loops`). Imported lazily, compiled on first use and
cached on disk like the filter's loops.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kalmanscan.ops.cpu_threads import PARALLEL
from kalmanscan.ops.filter.cpu.loops import ONE, S_DECAY, S_MEAN, S_NOISE, S_PMEAN, S_PVAR, S_VAR, TWO, ZERO, lanes


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def rts_forward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                outs: tuple[np.ndarray, ...],
                k: np.ndarray, T: int, C: int, W: int) -> None:
    """The RTS smoother over every series, backwards in time; ``ins``: filtered ``mean, var,
    pred_mean, pred_var, decay, noise`` (order ``S_MEAN .. S_NOISE``); writes ``outs`` =
    smoothed ``(mean, var, precision)``, each ``(B T C,)``.

    ``mean_s_t = mean_t + J_t (mean_s_{t+1} - pred_mean_{t+1})`` (the OU mean cancels: it is the
    centred recursion of :mod:`kalmanscan.inference.smoothing` with the offsets added back) and ``var_s_t =
    J_t^2 var_s_{t+1} + var_t q_{t+1} / pred_var_{t+1}``, ``J_t = a_{t+1} var_t / pred_var_{t+1}``.
    The variance is carried as the ratio ``rho_t = var_s_t / var_t = k_t + c_t g_{t+1} rho_{t+1}``
    (``k = q_{t+1} / pred_var_{t+1}``, ``c = a_{t+1} J_t``, 1 where ``q = 0``, ``g_{t+1} = var_{t+1} /
    pred_var_{t+1}``), the
    same function rearranged as :func:`kalmanscan.ops.filter.torch.smooth` scans it: ratios only,
    so no product of two variances leaves the dtype's range, and a predicted variance of 0 (no
    process noise) is read as its limit (:func:`kalmanscan.ops.filter.torch.rts_gains`: ``J = 0``,
    ``c = 1`` where ``a > 0``, ``c = 0`` where ``a = 0``, ``g = 1``). The adjoint differentiates the
    textbook form: the same function of the inputs wherever ``q > 0``; at a predicted variance of 0
    it follows the limit (nothing flows past the step).
    """
    mean_, var_, pmean_, pvar_, decay_, noise_ = ins
    o_mean, o_var, o_prec = outs
    t_mean, t_var, t_pmean, t_pvar = tstride[S_MEAN], tstride[S_VAR], tstride[S_PMEAN], tstride[S_PVAR]
    t_decay, t_noise = tstride[S_DECAY], tstride[S_NOISE]
    one, zero = k[ONE], k[ZERO]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        ms = np.empty(n, k.dtype)
        vs = np.empty(n, k.dtype)
        rho = np.empty(n, k.dtype)
        for t in range(T - 1, -1, -1):
            for j in range(n):
                o = obase[j] + t * C
                mu = mean_[base[S_MEAN, j] + t * t_mean]
                v = var_[base[S_VAR, j] + t * t_var]
                if t == T - 1:
                    ms[j] = mu
                    vs[j] = v
                    rho[j] = one
                else:
                    t1 = t + 1
                    a = decay_[base[S_DECAY, j] + t1 * t_decay]
                    q = noise_[base[S_NOISE, j] + t1 * t_noise]
                    pv = pvar_[base[S_PVAR, j] + t1 * t_pvar]
                    pm = pmean_[base[S_PMEAN, j] + t1 * t_pmean]
                    if pv > zero:
                        J = a * v / pv
                        share = q / pv
                        c = a * J if q > zero else one
                        g = var_[base[S_VAR, j] + t1 * t_var] / pv
                    else:
                        J = zero
                        c = one if a > zero else zero
                        share = one - c
                        g = one
                    ms[j] = mu + J * (ms[j] - pm)
                    rho[j] = share + c * g * rho[j]
                    vs[j] = v * rho[j]
                o_mean[o] = ms[j]
                o_var[o] = vs[j]
                o_prec[o] = one / vs[j]


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
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
        base, obase = lanes(boff, cstride, s0, n, T, C)
        cb, _ = lanes(cboff, ccstride, s0, n, T, C)
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
                    gv -= c_prec[cb[2, j] + t * ctstride[2]] / var_s[o] / var_s[o]
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
                if pv == zero:  # the forward's limit: J = 0 and var_s = var rho, the chain cut here
                    cm[j] = zero
                    cv[j] = zero
                    g_var[o] = gv * var_s[o] / v if v > zero else gv
                    g_pmean[o + C] = zero
                    g_pvar[o + C] = zero
                    if per_step:
                        g_decay[o + C] = zero
                        g_noise[o + C] = zero
                    continue
                vp = v / pv  # divisions, not 1 / pv: that overflows for a subnormal pv
                J = a * vp
                bJ = gm * (mean_s[o + C] - pm) + two * gv * J * var_s[o + C]
                cm[j] = gm * J
                cv[j] = gv * J * J
                g_var[o] = (gv * q + bJ * a) / pv
                g_pmean[o + C] = -gm * J
                g_pvar[o + C] = -(gv * vp * q + bJ * J) / pv
                if per_step:
                    g_decay[o + C] = bJ * vp
                    g_noise[o + C] = gv * vp
                else:
                    sums[0, j] += bJ * vp
                    sums[1, j] += gv * vp
        if not per_step:
            for j in range(n):
                g_decay[s0 + j] = sums[0, j]
                g_noise[s0 + j] = sums[1, j]
