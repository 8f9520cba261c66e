"""A high-precision oracle: the sequential Kalman filter and RTS smoother in mpmath at 60 digits.

It checks the float64 backends, the reference included, on the arithmetic of the filter alone:
the model's ``decay`` and ``noise`` come in as float64 values (the library's discretisation,
:func:`kalmanscan.ou.discretize`), and every input is read exactly (a float64 is an mpf without
rounding). From there each step is the textbook covariance-form recursion on the centred state
``z = x - mean``, carried in 60 significant digits with mpmath's unbounded exponent (nothing
underflows or overflows), and rounded once to float64 at the end: each field is the exact answer
to within the rounding of that last step, far beyond any float64 backend's own error.

    predict (t > 0):  z = a z,   P = a^2 P + q
    update:           S = h^2 P + R,  K = P h / S,  z += K (y - h mean - h z),  P = P R / S
    loglik:           -(log(2 pi) + log S + innovation^2 / S) / 2    (0 where y is NaN)
    RTS:              J = a P_t / Ppred_{t+1},  z_s = z + J (z_s' - zpred'),
                      P_s = P + J^2 (P_s' - Ppred')   (J = 0 where Ppred' = 0)

A diffuse prior (``init_var = inf``) follows the library's convention
(:mod:`kalmanscan.inference.diffuse`): the state is unknown (variance inf, mean the OU mean,
log-likelihood 0) up to the channel's first observation ``y_f``, after which it is
``N(y_f / h_f, obs_var_f / h_f^2)`` (centred) and that log-density is left out; the smoother goes
back from ``f`` through the transitions, ``z_s = z_s' / a``, ``P_s = (P_s' + q) / a^2``.

Shapes: ``y`` and every per-step input broadcast to ``(..., T, C)``; ``init_mean`` and
``init_var`` to ``(..., C)``. It costs some 50 mpmath operations per element: meant for the
small problems of the tests (a few hundred elements).
"""

from __future__ import annotations

import mpmath
import numpy as np

DIGITS = 60

FIELDS = ("mean", "var", "pred_mean", "pred_var", "logliks")


def filter(y, decay, noise, obs_var, h, mean, init_mean, init_var) -> dict[str, np.ndarray]:
    """The filter's ``mean, var, pred_mean, pred_var, logliks`` ``(..., T, C)`` and ``loglik``
    ``(..., C)``, each the float64 rounding of the 60-digit result."""
    return _run(y, decay, noise, obs_var, h, mean, init_mean, init_var, smooth=False)


def smooth(y, decay, noise, obs_var, h, mean, init_mean, init_var) -> dict[str, np.ndarray]:
    """:func:`filter`'s fields and the smoothed ``smooth_mean, smooth_var`` ``(..., T, C)``."""
    return _run(y, decay, noise, obs_var, h, mean, init_mean, init_var, smooth=True)


def _run(y, decay, noise, obs_var, h, mean, init_mean, init_var, smooth: bool) -> dict[str, np.ndarray]:
    y = np.asarray(y, dtype=np.float64)
    shape = np.broadcast_shapes(y.shape, *(np.shape(x) for x in (decay, noise, obs_var, h, mean)))
    cshape = np.broadcast_shapes(shape[:-2] + shape[-1:], np.shape(init_mean), np.shape(init_var))
    shape = cshape[:-1] + shape[-2:-1] + cshape[-1:]
    steps = {k: np.broadcast_to(np.asarray(x, dtype=np.float64), shape)
             for k, x in dict(y=y, a=decay, q=noise, R=obs_var, h=h, m=mean).items()}
    inits = {k: np.broadcast_to(np.asarray(x, dtype=np.float64), cshape)
             for k, x in dict(mu0=init_mean, v0=init_var).items()}
    names = FIELDS + (("smooth_mean", "smooth_var") if smooth else ())
    out = {k: np.empty(shape) for k in names}
    with mpmath.workdps(DIGITS):
        for index in np.ndindex(cshape):
            batch, c = index[:-1], index[-1]
            series = {k: [mpmath.mpf(float(v)) for v in x[batch + (slice(None), c)]] for k, x in steps.items()}
            moments = _series(**series, mu0=mpmath.mpf(float(inits["mu0"][index])),
                              v0=mpmath.mpf(float(inits["v0"][index])), smooth=smooth)
            for k in names:
                out[k][batch + (slice(None), c)] = [float(v) for v in moments[k]]
    out["loglik"] = out["logliks"].sum(-2)
    return out


def _series(y, a, q, R, h, m, mu0, v0, smooth: bool) -> dict[str, list]:
    """One channel's recursions in mpmath (the module docstring); lists of length ``T``."""
    T, inf = len(y), mpmath.inf
    z, P, known = mu0 - m[0], v0, not mpmath.isinf(v0)
    first = 0 if known else T  # first step at which the state is known
    rec = {k: [] for k in FIELDS}
    zf, Pf, zp, Pp = [], [], [], []
    for t in range(T):
        if t > 0 and known:
            z, P = a[t] * z, a[t] ** 2 * P + q[t]
        zp.append(z if known else mpmath.mpf(0))
        Pp.append(P if known else inf)
        ll = mpmath.mpf(0)
        if not mpmath.isnan(y[t]):
            innovation = y[t] - h[t] * m[t] - h[t] * z
            if known:
                S = h[t] ** 2 * P + R[t]
                z, P = z + P * h[t] / S * innovation, P * R[t] / S
                ll = -(mpmath.log(2 * mpmath.pi) + mpmath.log(S) + innovation ** 2 / S) / 2
            else:  # a diffuse channel's first observation
                z, P, known, first = (y[t] - h[t] * m[t]) / h[t], R[t] / h[t] ** 2, True, t
        zf.append(z if known else mpmath.mpf(0))
        Pf.append(P if known else inf)
        rec["logliks"].append(ll)
    rec["mean"] = [zt + mt for zt, mt in zip(zf, m)]
    rec["var"] = Pf
    rec["pred_mean"] = [zt + mt for zt, mt in zip(zp, m)]
    rec["pred_var"] = Pp
    if smooth:
        zs, Ps = _rts(zf, Pf, zp, Pp, a, q, first)
        rec["smooth_mean"] = [zt + mt for zt, mt in zip(zs, m)]
        rec["smooth_var"] = Ps
    return rec


def _rts(zf, Pf, zp, Pp, a, q, first: int) -> tuple[list, list]:
    """The smoothed centred mean and variance from the filter's centred moments: RTS from the
    first known step on, the transitions inverted before it (a diffuse channel)."""
    T = len(zf)
    zs, Ps = list(zf), list(Pf)
    if first >= T:  # never observed under a diffuse prior: unknown throughout
        return zs, Ps
    for t in range(T - 2, -1, -1):
        if t >= first:
            J = mpmath.mpf(0) if Pp[t + 1] == 0 else a[t + 1] * Pf[t] / Pp[t + 1]
            zs[t] = zf[t] + J * (zs[t + 1] - zp[t + 1])
            Ps[t] = Pf[t] + J ** 2 * (Ps[t + 1] - Pp[t + 1])
        else:
            zs[t] = zs[t + 1] / a[t + 1]
            Ps[t] = (Ps[t + 1] + q[t + 1]) / a[t + 1] ** 2
    return zs, Ps

