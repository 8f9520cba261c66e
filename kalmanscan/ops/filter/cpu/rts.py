"""The compiled RTS smoother of the ``"cpu"`` backend and its adjoint (the layout and constants
are in :mod:`kalmanscan.ops.filter.cpu.loops`). Imported lazily, compiled on first use and
cached on disk like the filter's loops.

The mean is smoothed on the centred state ``z = mean - level`` (``level`` the OU mean) in the
form whose coefficients are non-negative, ``z_s_t = e_t z_t + J_t z_s_{t+1}`` with ``J_t =
a_{t+1} var_t / pred_var_{t+1}`` and ``e_t = 1 - a_{t+1} J_t = q_{t+1} / pred_var_{t+1}``: the
textbook ``z_t + J_t (z_s_{t+1} - a_{t+1} z_t)`` with the prediction cancelled exactly. The
textbook difference is of the size of the next step's update while ``J`` reaches ``1 / a``
without process noise, so through ``k`` steps without an observation its error (and that of its
gradient) grew as ``a^-k``; here every term is of the size of the result. Without process noise
``J = 1 / a`` and ``e = 0`` exactly (the next state is ``a x_t``); a predicted variance of 0 is
read as its limit (:func:`kalmanscan.ops.filter.torch.rts_gains`): ``J = 0``, ``e = 1``. At ``q =
0`` the adjoint passes nothing to ``q``: the process noise ``sigma^2 (...)`` of every parameter
has derivative 0 at ``sigma = 0``, and the one-sided derivative ``1 / pred_var`` may overflow (an
infinite cotangent times that 0 would be NaN).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kalmanscan.ops.cpu_threads import PARALLEL
from kalmanscan.ops.filter.cpu.loops import ONE, S_DECAY, S_LEVEL, S_MEAN, S_NOISE, S_PVAR, S_VAR, TINY, ZERO, lanes


@njit(inline="always")
def gains(a: float, q: float, pv: float, v: float, v_next: float, k: np.ndarray) -> tuple[float, ...]:
    """``(J, e, share, c, g)`` of one step: the mean's ``z_s_t = e z_t + J z_s_{t+1}`` and the
    variance ratio's ``rho_t = share + c g rho_{t+1}`` from the filtered variances ``v, v_next`` at
    ``t, t + 1`` and the transition into ``t + 1`` (``a, q``, predicted variance ``pv``)."""
    one, zero = k[ONE], k[ZERO]
    if pv == zero:  # the limit (module doc)
        c = one if a > zero else zero
        return zero, one, one - c, c, one
    g = v_next / pv if pv >= k[TINY] else one  # ~1 to within h^2 pv / obs_var where pv is subnormal
    if q > zero:
        J = a * (v / pv)
        share = q / pv
        return J, share, share, a * J, g
    return one / a, zero, zero, one, g


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def rts_forward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                outs: tuple[np.ndarray, ...], keep: bool,
                k: np.ndarray, T: int, C: int, W: int) -> None:
    """The RTS smoother over every series, backwards in time; ``ins``: filtered ``mean, var``, the
    OU mean ``level``, ``pred_var, decay, noise`` (order ``S_MEAN .. S_NOISE``); writes ``outs`` =
    smoothed ``(mean, var, precision, z_s, rho)``, each ``(B T C,)``, the centred smoothed mean
    ``z_s`` and the variance ratio ``rho`` (the adjoint's) where ``keep`` (else placeholders). At
    the last step the smoothed mean is the filtered one as given.

    Mean as in the module docstring. The variance is carried as the ratio ``rho_t = var_s_t /
    var_t = k_t + c_t g_{t+1} rho_{t+1}`` (``k = q_{t+1} / pred_var_{t+1}``, ``c = a_{t+1} J_t``, 1
    where ``q = 0``, ``g_{t+1} = var_{t+1} / pred_var_{t+1}``, 1 where ``pred_var`` is subnormal),
    the textbook ``var_s_t = J_t^2 var_s_{t+1} + var_t q_{t+1} / pred_var_{t+1}`` rearranged as
    :func:`kalmanscan.ops.filter.torch.smooth` scans it: ratios only, so no product of two
    variances leaves the dtype's range, and a predicted variance of 0 (no process noise) is read
    as its limit (``J = 0``, ``c = 1`` where ``a > 0``, ``c = 0`` where ``a = 0``, ``g = 1``).
    """
    mean_, var_, level_, pvar_, decay_, noise_ = ins
    o_mean, o_var, o_prec, o_zs, o_rho = outs
    t_mean, t_var, t_level, t_pvar = tstride[S_MEAN], tstride[S_VAR], tstride[S_LEVEL], tstride[S_PVAR]
    t_decay, t_noise = tstride[S_DECAY], tstride[S_NOISE]
    one = k[ONE]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        zs = np.empty(n, k.dtype)
        vs = np.empty(n, k.dtype)
        rho = np.empty(n, k.dtype)
        for t in range(T - 1, -1, -1):
            for j in range(n):
                o = obase[j] + t * C
                mu = mean_[base[S_MEAN, j] + t * t_mean]
                lev = level_[base[S_LEVEL, j] + t * t_level]
                v = var_[base[S_VAR, j] + t * t_var]
                if t == T - 1:
                    zs[j] = mu - lev
                    vs[j] = v
                    rho[j] = one
                    o_mean[o] = mu
                else:
                    t1 = t + 1
                    J, e, share, c, g = gains(decay_[base[S_DECAY, j] + t1 * t_decay],
                                              noise_[base[S_NOISE, j] + t1 * t_noise],
                                              pvar_[base[S_PVAR, j] + t1 * t_pvar], v,
                                              var_[base[S_VAR, j] + t1 * t_var], k)
                    zs[j] = e * (mu - lev) + J * zs[j]
                    rho[j] = share + c * g * rho[j]
                    vs[j] = v * rho[j]
                    o_mean[o] = zs[j] + lev
                if keep:
                    o_zs[o] = zs[j]
                    o_rho[o] = rho[j]
                o_var[o] = vs[j]
                o_prec[o] = one / vs[j]


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def rts_backward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                 zs: np.ndarray,
                 rho: np.ndarray, cots: tuple[np.ndarray, ...], cboff: np.ndarray, ctstride: np.ndarray,
                 ccstride: np.ndarray,
                 has: np.ndarray, grads: tuple[np.ndarray, ...], step: np.ndarray, k: np.ndarray, T: int, C: int,
                 W: int) -> None:
    """The adjoints of :func:`rts_forward` (of its own form: the mean's map and the variance's
    ratio, so the carried cotangents stay within the gains' ``[0, 1]`` and the size of ``1 / a``
    per step, where the textbook form's carried ``J^2``), forwards in time. ``zs, rho``: its
    centred smoothed mean and variance ratio; ``cots``: cotangents of its three outputs, read
    through ``cboff, ctstride, ccstride`` (placeholders where ``has`` is unset). Writes ``grads`` in
    the order of ``ins``: ``(B T C,)`` arrays for ``mean, var, level, pred_var``; for ``decay,
    noise`` per step where ``step`` is set, else per-series sums ``(B C,)`` (accumulated in
    float64). Constant gains (the limit at a predicted variance of 0, ``g`` at a subnormal one, the
    shares at ``q = 0``: module doc) pass nothing to their inputs."""
    mean_, var_, level_, pvar_, decay_, noise_ = ins
    c_mean, c_var, c_prec = cots
    h_mean, h_var, h_prec = has[0], has[1], has[2]
    g_mean, g_var, g_level, g_pvar, g_decay, g_noise = grads
    per_step = step[0]
    t_mean, t_var, t_level, t_pvar = tstride[S_MEAN], tstride[S_VAR], tstride[S_LEVEL], tstride[S_PVAR]
    t_decay, t_noise = tstride[S_DECAY], tstride[S_NOISE]
    zero = k[ZERO]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        cb, _ = lanes(cboff, ccstride, s0, n, T, C)
        cm = np.zeros(n, k.dtype)  # the cotangents carried from step t - 1: of z_s_t, rho_t, var_t
        cr = np.zeros(n, k.dtype)
        cvn = np.zeros(n, k.dtype)
        sums = np.zeros((2, n), np.float64)
        for t in range(T):
            for j in range(n):
                o = obase[j] + t * C
                v = var_[base[S_VAR, j] + t * t_var]
                r = rho[o]
                out_m = c_mean[cb[0, j] + t * ctstride[0]] if h_mean else zero
                gm = cm[j] + out_m  # the cotangent of z_s_t (the smoothed mean is z_s_t + level_t)
                gvs = zero  # ... and of var_s_t = v rho_t
                if h_var:
                    gvs += c_var[cb[1, j] + t * ctstride[1]]
                if h_prec:
                    vs = v * r
                    gvs -= c_prec[cb[2, j] + t * ctstride[2]] / vs / vs
                gr = cr[j] + gvs * v
                gvar = gvs * r + cvn[j]
                if t == 0:
                    g_pvar[o] = zero
                    if per_step:
                        g_decay[o] = zero
                        g_noise[o] = zero
                if t == T - 1:
                    g_mean[o] = gm
                    g_level[o] = out_m - gm
                    g_var[o] = gvar
                    continue
                t1 = t + 1
                a = decay_[base[S_DECAY, j] + t1 * t_decay]
                q = noise_[base[S_NOISE, j] + t1 * t_noise]
                pv = pvar_[base[S_PVAR, j] + t1 * t_pvar]
                J, e, share, c, g = gains(a, q, pv, v, var_[base[S_VAR, j] + t1 * t_var], k)
                r1 = rho[o + C]
                cm[j] = gm * J
                cr[j] = gr * c * g
                ga = zero
                gq = zero
                gpv = zero
                cvn[j] = zero
                if pv > zero:
                    gJ = gm * zs[o + C]
                    if pv >= k[TINY]:  # g = v_next / pv
                        gg = gr * c * r1
                        cvn[j] = gg / pv
                        gpv -= gg * g / pv
                    if q > zero:  # J = a v / pv, share = e = q / pv, c = a J
                        gJ += gr * g * r1 * a
                        gsh = gr + gm * (mean_[base[S_MEAN, j] + t * t_mean] - level_[base[S_LEVEL, j] + t * t_level])
                        ga = gr * g * r1 * J + gJ * (v / pv)
                        gvar += (gJ * a) / pv
                        gpv -= (gJ * J + gsh * share) / pv
                        gq = gsh / pv
                    else:  # J = 1 / a
                        ga = -(gJ * J) / a
                g_mean[o] = gm * e
                g_level[o] = out_m - gm * e
                g_var[o] = gvar
                g_pvar[o + C] = gpv
                if per_step:
                    g_decay[o + C] = ga
                    g_noise[o + C] = gq
                else:
                    sums[0, j] += ga
                    sums[1, j] += gq
        if not per_step:
            for j in range(n):
                g_decay[s0 + j] = sums[0, j]
                g_noise[s0 + j] = sums[1, j]
