"""The ``"cpu"`` backend's filter, derived fields and smoother for small float64 work, without
numba: the operations of the compiled loops (:mod:`kalmanscan.ops.filter.cpu.loops`,
:mod:`~kalmanscan.ops.filter.cpu.derive`, :mod:`~kalmanscan.ops.filter.cpu.rts`) in the same
order, the recursions one series at a time in Python floats and the elementwise fields in NumPy,
so the same bits.

Why: a process's first compiled call pays numba's start (importing it, its typing registries and
SciPy's BLAS check: about 0.4 s of CPU before any loop runs, though the loops themselves come from
the on-disk cache), where a small problem needs a few milliseconds. :func:`small` decides by size
alone (:attr:`kalmanscan.tuning.Tuning.numpy_work`), so a call takes the same path every time;
either path gives the same numbers, bit for bit.

Same bits: ``+ - * /`` are correctly rounded in NumPy as in the compiled code; ``exp``, ``expm1``
and ``log`` are the C library's, called through :mod:`math` element by element as the compiled
loops call them (NumPy's own vectorised ``exp`` and ``log`` may differ in the last bit). Float64
only: the compiled loops compute float32 in float32, which Python's scalar functions do not.
Shapes: the inputs are NumPy arrays broadcastable to ``shape = (..., T, C)``, read through
broadcast views (nothing copied); outputs are ``shape`` arrays written series by series. Cost: a
microsecond or two an element-step, against some 0.05 for the compiled loops once numba has started.
"""

from __future__ import annotations

import math

import numpy as np

from kalmanscan import tuning

__all__ = ["small", "forward", "derive", "rts", "FIELDS", "DERIVED"]

# The forward's outputs (the loops' order) and the derived fields (derive_fields' order).
FIELDS = ("mean", "var", "precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean",
          "pred_obs_var", "logliks", "missing", "zc")
DERIVED = ("precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean", "pred_obs_var", "logliks",
           "missing")
LOG2PI = math.log(2.0 * math.pi)
TAYLOR = 1e-4  # 2 theta dt below which the noise's expm1 quotient is its Taylor series (loops.discretize)
SIXTH = 1.0 / 6.0
TINY = float(np.finfo(np.float64).tiny)  # below it a predicted variance's g is read as 1 (rts.gains)


def small(dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    """Whether a problem of ``shape`` in ``dtype`` runs here: float64 and at most
    :attr:`~kalmanscan.tuning.Tuning.numpy_work` element-steps."""
    return np.dtype(dtype) == np.float64 and math.prod(shape) <= tuning.current().numpy_work


def _log(x: float) -> float:
    """``log x``, with ``-inf`` at 0 and NaN below, as the compiled loops' (``error_model="numpy"``)."""
    return math.log(x) if x > 0.0 else -math.inf if x == 0.0 else math.nan


def _inv(x: float) -> float:
    """``1 / x``, ``inf`` at 0 (a variance of 0 has precision inf), as the compiled loops'."""
    return 1.0 / x if x != 0.0 else math.copysign(math.inf, x)


def discretize(theta: float, sigma: float, dt: float) -> tuple[float, float]:
    """``(decay, noise)``: :func:`kalmanscan.ops.filter.cpu.loops.discretize`, same operations."""
    x = theta * dt
    decay = math.exp(-x)
    x2 = x + x
    if x2 < TAYLOR:
        phi = 1.0 - x2 * (0.5 - x2 * (SIXTH - x2 / 24.0))
    else:
        phi = -math.expm1(-x2) / x2
    return decay, sigma * sigma * dt * phi


def forward(ins: tuple[np.ndarray, ...], shape: tuple[int, ...], outs: dict[str, np.ndarray],
            llsum: np.ndarray | None) -> None:
    """The filter of every series: ``ins`` the 9 inputs of the loops (``y, theta, sigma, dt,
    obs_var, mean, h, init_mean, init_var``, float64 arrays broadcastable to ``shape``); writes
    the fields of :data:`FIELDS` present in ``outs`` (``shape`` arrays; ``zc`` the centred filtered
    mean) and, when given, each series' log-likelihood summed over time in float64 into ``llsum``
    (``shape[:-2] + (C,)``). The loops' recursion (:mod:`kalmanscan.ops.filter.cpu.loops`), one
    series at a time in Python floats (a step costs about a microsecond)."""
    arrays = [np.broadcast_to(x, shape) for x in ins]
    T = shape[-2]
    for index in np.ndindex(shape[:-2] + shape[-1:]):
        at = index[:-1] + (slice(None), index[-1])
        y, theta, sigma, dt, R, m, h, im, iv = (x[at] for x in arrays)
        if theta.strides[0] == sigma.strides[0] == dt.strides[0] == 0:
            a, q = discretize(float(theta[0]), float(sigma[0]), float(dt[0]))
            steps = [(a, q)] * T
        else:
            steps = list(map(discretize, theta.tolist(), sigma.tolist(), dt.tolist()))
        rows, total = _series(y.tolist(), steps, R.tolist(), m.tolist(), h.tolist(), float(im[0]), float(iv[0]))
        z, Pf, iPf, zp, Pp, iPp, S, ll, miss = np.array(rows, dtype=np.float64).reshape(T, 9).T
        fields = {"mean": lambda: z + m, "var": lambda: Pf, "precision": lambda: iPf, "pred_mean": lambda: zp + m,
                  "pred_var": lambda: Pp, "pred_precision": lambda: iPp, "pred_obs_mean": lambda: h * (zp + m),
                  "pred_obs_var": lambda: S, "logliks": lambda: ll, "missing": lambda: miss, "zc": lambda: z}
        for k, out in outs.items():
            out[at] = fields[k]()
        if llsum is not None:
            llsum[index] = total


def _series(y: list, steps: list, R: list, m: list, h: list, im: float, iv: float) -> tuple[list, float]:
    """One series' step of ``filter_forward``: rows ``(z, var, precision, zp, pred_var,
    pred_precision, S, loglik, missing)`` per step (``z, zp`` the centred filtered and predicted
    means) and the log-likelihood summed in order."""
    rows = []
    z, P, total = im - m[0], iv, 0.0
    for t, (yt, (a, q), Rt, mt, ht) in enumerate(zip(y, steps, R, m, h)):
        zp, Pp = z, P
        if t > 0:
            zp = a * zp
            Pp = a * a * Pp + q
        S = ht * ht * Pp + Rt
        iS = 1.0 / S
        iPp = _inv(Pp)
        if yt != yt:  # missing
            rows.append((zp, Pp, iPp, zp, Pp, iPp, S, 0.0, 1.0))
            z, P = zp, Pp
            continue
        P = Pp * (Rt * iS)
        K = Pp * ht * iS
        v = (yt - ht * mt) - ht * zp
        z = zp + K * v
        ll = -0.5 * ((LOG2PI + _log(S)) + v * v * iS)
        total += ll
        rows.append((z, P, _inv(P), zp, Pp, iPp, S, ll, 0.0))
    return rows, total


def derive(ins: tuple[np.ndarray, ...], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The :data:`DERIVED` fields as ``shape`` arrays from ``ins``: the 9 inputs of :func:`forward`
    and the filtered mean and variance (:func:`kalmanscan.ops.filter.cpu.derive.derive_fields`'s
    operations, every step at once; ``exp``, ``expm1`` and ``log`` element by element)."""
    y, th, si, dt, R, m, h, im, iv, fm, fv = (np.broadcast_to(x, shape) for x in ins)
    a, q = (x.astype(np.float64) for x in np.frompyfunc(discretize, 3, 2)(th[..., 1:, :], si[..., 1:, :],
                                                                          dt[..., 1:, :]))
    zp = np.concatenate([im[..., :1, :] - m[..., :1, :], a * (fm[..., :-1, :] - m[..., :-1, :])], -2)
    Pp = np.concatenate([iv[..., :1, :], a * a * fv[..., :-1, :] + q], -2)
    S = h * h * Pp + R
    miss = np.isnan(y)
    v = (y - h * m) - h * zp
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lS = LOG2PI + np.frompyfunc(_log, 1, 1)(S).astype(np.float64)
        ll = np.where(miss, 0.0, -0.5 * (lS + v * v * (1.0 / S)))
        return dict(precision=1.0 / fv, pred_mean=zp + m, pred_var=Pp, pred_precision=1.0 / Pp,
                    pred_obs_mean=h * (zp + m), pred_obs_var=S, logliks=ll, missing=miss.astype(np.float64))


def rts(ins: tuple[np.ndarray, ...], shape: tuple[int, ...], outs: tuple[np.ndarray, ...]) -> None:
    """The smoother of every series: ``ins`` the filtered ``mean, var``, the OU mean ``level``,
    ``pred_var, decay, noise`` (float64 arrays broadcastable to ``shape``); writes the smoothed
    ``(mean, var, precision)`` into ``outs`` (``shape`` arrays). The recursion of
    :func:`kalmanscan.ops.filter.cpu.rts.rts_forward`."""
    arrays = [np.broadcast_to(x, shape) for x in ins]
    for index in np.ndindex(shape[:-2] + shape[-1:]):
        at = index[:-1] + (slice(None), index[-1])
        rows = _rts_series(*(x[at].tolist() for x in arrays))
        for out, values in zip(outs, np.array(rows, dtype=np.float64).reshape(shape[-2], 3).T):
            out[at] = values[::-1]


def _rts_series(mean: list, var: list, level: list, pred_var: list, decay: list, noise: list) -> list:
    """One series' smoothed ``(mean, var, precision)`` rows, last step first."""
    T = len(mean)
    zs, vs, rho = mean[-1] - level[-1], var[-1], 1.0
    rows = [(mean[-1], vs, _inv(vs))]
    for t in range(T - 2, -1, -1):
        a, q, pv, v = decay[t + 1], noise[t + 1], pred_var[t + 1], var[t]
        if pv > 0.0:
            if q > 0.0:
                J = a * (v / pv)
                share = q / pv
                c = a * J
            else:
                J, share, c = 1.0 / a, 0.0, 1.0
            e, g = share, var[t + 1] / pv if pv >= TINY else 1.0
        else:
            J, e, g = 0.0, 1.0, 1.0
            c = 1.0 if a > 0.0 else 0.0
            share = 1.0 - c
        zs = e * (mean[t] - level[t]) + J * zs
        rho = share + c * g * rho
        vs = v * rho
        rows.append((zs + level[t], vs, _inv(vs)))
    return rows
