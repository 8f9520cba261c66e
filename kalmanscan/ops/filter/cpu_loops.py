"""The compiled forward loops of the ``"cpu"`` backend (:mod:`kalmanscan.ops.filter.cpu`), in
numba, and what the other loop modules share (:mod:`~kalmanscan.ops.filter.cpu_adjoint`, the
filter's reverse recursion; :mod:`~kalmanscan.ops.filter.cpu_rts`, the smoother).

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
The variance terms of a step (:func:`variance_terms`: two divisions and a logarithm) depend on
the incoming variance, the parameters and whether ``y`` is missing, not on ``y``: where the
parameters are static they are reused while the incoming variance repeats (the Riccati recursion
reaches its fixed point in floating point), the same values, bit for bit, as recomputing them.
Both forward loops compute a step with the same two functions (:func:`variance_terms`,
:func:`mean_terms`), so they give the same bits.
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
# Cached variance terms of the static loop (rows of its per-task cache).
(K_P, K_PP, K_S, K_IS, K_K, K_PF, K_LS, K_IPF, K_IPP) = range(9)


# Only the prange loops become parallel: numba's other parfor conversions (array expressions,
# reductions, fusion) find nothing to do here but cost compile time.
PARALLEL = dict(prange=True, comprehension=False, setitem=False, reduction=False, numpy=False, stencil=False,
                fusion=False, inplace_binop=False)


def constants(dtype: np.dtype | type) -> np.ndarray:
    """The array ``consts`` of the loops in ``dtype``."""
    return np.array([0.5, 1.0 / 6.0, 24.0, 1e-4, math.log(2.0 * math.pi), 0.0, 1.0, 2.0], dtype=dtype)


@njit(inline="always")
def discretize(theta: float, sigma: float, dt: float, k: np.ndarray) -> tuple[float, float]:
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
def lanes(boff: np.ndarray, cstride: np.ndarray, s0: int, n: int, T: int, C: int) -> tuple[np.ndarray, np.ndarray]:
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


@njit(inline="always")
def static_transitions(th_: np.ndarray, si_: np.ndarray, dt_: np.ndarray, base: np.ndarray, n: int,
                       trans_step: bool, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each lane's ``(decay, noise)`` ``(n,)`` when theta, sigma and dt are static (``trans_step``
    false); unset otherwise (:func:`transition` then computes them per step)."""
    A = np.empty(n, k.dtype)
    Q = np.empty(n, k.dtype)
    if not trans_step:
        for j in range(n):
            A[j], Q[j] = discretize(th_[base[THETA, j]], si_[base[SIGMA, j]], dt_[base[DT, j]], k)
    return A, Q


@njit(inline="always")
def transition(th_: np.ndarray, si_: np.ndarray, dt_: np.ndarray, base: np.ndarray, j: int, t: int,
               t_th: int, t_si: int, t_dt: int, trans_step: bool, A: np.ndarray, Q: np.ndarray,
               k: np.ndarray) -> tuple[float, float]:
    """Lane ``j``'s ``(decay, noise)`` into step ``t``: discretised from the step's parameters
    with ``trans_step``, else the lane's static pair from :func:`static_transitions`."""
    if trans_step:
        return discretize(th_[base[THETA, j] + t * t_th], si_[base[SIGMA, j] + t * t_si],
                          dt_[base[DT, j] + t * t_dt], k)
    return A[j], Q[j]


@njit(inline="always")
def variance_terms(Pp: float, h: float, R: float, miss: bool, k: np.ndarray) -> tuple[float, ...]:
    """``(S, 1/S, K, P, log(2 pi) + log S, 1/P, 1/Pp)`` of a step with predicted variance ``Pp``;
    a missing step keeps ``P = Pp`` with ``K = 0`` (its ``log S`` term is unused)."""
    S = h * h * Pp + R
    iS = k[ONE] / S
    iPp = k[ONE] / Pp
    if miss:
        return S, iS, k[ZERO], Pp, k[ZERO], iPp, iPp
    Pf = Pp * R * iS
    return S, iS, Pp * h * iS, Pf, k[LOG2PI] + math.log(S), k[ONE] / Pf, iPp


@njit(inline="always")
def mean_terms(y: float, zp: float, h: float, m: float, K: float, lS: float, iS: float, miss: bool,
               k: np.ndarray) -> tuple[float, float]:
    """``(z, loglik)`` of a step: the centred filtered mean and the log-density of ``y``."""
    if miss:
        return zp, k[ZERO]
    v = (y - h * m) - h * zp
    return zp + K * v, -k[HALF] * (lS + v * v * iS)


@njit(inline="always")
def flags(write: np.ndarray) -> tuple[bool, ...]:
    """The output flags ``write`` as a tuple of booleans: values the compiler keeps out of the loops
    (an array would be re-read after every store to an output, which it may alias)."""
    return (write[O_MEAN], write[O_VAR], write[O_PREC], write[O_PMEAN], write[O_PVAR], write[O_PPREC],
            write[O_POMEAN], write[O_POVAR], write[O_LL], write[O_MISS], write[O_ZC])


@njit(inline="always")
def write_step(outs: tuple[np.ndarray, ...], w: tuple[bool, ...], o: int, zf: float, Pf: float, iPf: float, zp: float,
               Pp: float, iPp: float, h: float, m: float, S: float, ll: float, miss: bool, k: np.ndarray) -> None:
    """Write a step's outputs flagged in ``w`` (:func:`flags`) at element ``o``."""
    if w[O_MEAN]:
        outs[O_MEAN][o] = zf + m
    if w[O_VAR]:
        outs[O_VAR][o] = Pf
    if w[O_PREC]:
        outs[O_PREC][o] = iPf
    if w[O_PMEAN]:
        outs[O_PMEAN][o] = zp + m
    if w[O_PVAR]:
        outs[O_PVAR][o] = Pp
    if w[O_PPREC]:
        outs[O_PPREC][o] = iPp
    if w[O_POMEAN]:
        outs[O_POMEAN][o] = h * (zp + m)
    if w[O_POVAR]:
        outs[O_POVAR][o] = S
    if w[O_LL]:
        outs[O_LL][o] = ll
    if w[O_MISS]:
        outs[O_MISS][o] = k[ONE] if miss else k[ZERO]
    if w[O_ZC]:
        outs[O_ZC][o] = zf


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def filter_forward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                   outs: tuple[np.ndarray, ...],
                   write: np.ndarray, k: np.ndarray, T: int, C: int, W: int, trans_step: bool) -> None:
    """The filter over every series; writes the outputs flagged in ``write`` (see module doc).

    ``ins``: 9 input arrays (order ``Y .. INIT_VAR``); ``outs``: 11 output arrays (``O_MEAN ..
    O_ZC``, the last the centred filtered mean the backward reads), each ``(B T C,)`` where
    ``write`` is set, else a placeholder. ``trans_step``: theta, sigma or dt vary along time (else
    decay and noise are computed once per series). Any parameter may vary along time; with every
    one static :func:`filter_static` is the faster loop (the same bits).
    """
    y_, th_, si_, dt_, R_, m_, h_, im_, iv_ = ins
    w = flags(write)
    t_y, t_th, t_si, t_dt = tstride[Y], tstride[THETA], tstride[SIGMA], tstride[DT]
    t_R, t_m, t_h = tstride[OBS_VAR], tstride[MEAN], tstride[H]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        z = np.empty(n, k.dtype)
        P = np.empty(n, k.dtype)
        A, Q = static_transitions(th_, si_, dt_, base, n, trans_step, k)
        for j in range(n):
            z[j] = im_[base[INIT_MEAN, j]] - m_[base[MEAN, j]]
            P[j] = iv_[base[INIT_VAR, j]]
        for t in range(T):
            for j in range(n):
                y = y_[base[Y, j] + t * t_y]
                h = h_[base[H, j] + t * t_h]
                m = m_[base[MEAN, j] + t * t_m]
                R = R_[base[OBS_VAR, j] + t * t_R]
                miss = math.isnan(y)
                zp = z[j]
                Pp = P[j]
                if t > 0:
                    a, q = transition(th_, si_, dt_, base, j, t, t_th, t_si, t_dt, trans_step, A, Q, k)
                    zp = a * zp
                    Pp = a * a * Pp + q
                S, iS, K, Pf, lS, iPf, iPp = variance_terms(Pp, h, R, miss, k)
                zf, ll = mean_terms(y, zp, h, m, K, lS, iS, miss, k)
                z[j] = zf
                P[j] = Pf
                write_step(outs, w, obase[j] + t * C, zf, Pf, iPf, zp, Pp, iPp, h, m, S, ll, miss, k)


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def filter_static(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                  outs: tuple[np.ndarray, ...], write: np.ndarray, k: np.ndarray, T: int, C: int, W: int) -> None:
    """:func:`filter_forward` where only ``y`` varies along time (same arguments, same bits).

    Each lane's parameters are read once; an observed step whose incoming variance equals that of
    the last observed step reuses its variance terms (module doc), so once the variance has
    converged a step costs a few multiplications and the writes, no division or logarithm.
    """
    y_, th_, si_, dt_, R_, m_, h_, im_, iv_ = ins
    w = flags(write)
    t_y = tstride[Y]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        z = np.empty(n, k.dtype)
        P = np.empty(n, k.dtype)
        par = np.empty((5, n), k.dtype)  # decay, noise, obs_var, h, mean
        cache = np.full((9, n), np.nan, k.dtype)
        for j in range(n):
            par[2, j] = R_[base[OBS_VAR, j]]
            par[3, j] = h_[base[H, j]]
            par[4, j] = m_[base[MEAN, j]]
            par[0, j], par[1, j] = discretize(th_[base[THETA, j]], si_[base[SIGMA, j]], dt_[base[DT, j]], k)
            z[j] = im_[base[INIT_MEAN, j]] - par[4, j]
            P[j] = iv_[base[INIT_VAR, j]]
        for t in range(T):
            for j in range(n):
                a, q, R, h, m = par[0, j], par[1, j], par[2, j], par[3, j], par[4, j]
                y = y_[base[Y, j] + t * t_y]
                miss = math.isnan(y)
                zp = z[j]
                Pj = P[j]
                Pp = Pj
                if t > 0:
                    zp = a * zp
                    if not miss and Pj == cache[K_P, j]:
                        Pp = cache[K_PP, j]
                    else:
                        Pp = a * a * Pj + q
                if t > 0 and not miss and Pj == cache[K_P, j]:
                    S, iS, K, Pf = cache[K_S, j], cache[K_IS, j], cache[K_K, j], cache[K_PF, j]
                    lS, iPf, iPp = cache[K_LS, j], cache[K_IPF, j], cache[K_IPP, j]
                else:
                    S, iS, K, Pf, lS, iPf, iPp = variance_terms(Pp, h, R, miss, k)
                    if t > 0 and not miss:
                        cache[K_P, j], cache[K_PP, j], cache[K_S, j], cache[K_IS, j] = Pj, Pp, S, iS
                        cache[K_K, j], cache[K_PF, j], cache[K_LS, j] = K, Pf, lS
                        cache[K_IPF, j], cache[K_IPP, j] = iPf, iPp
                zf, ll = mean_terms(y, zp, h, m, K, lS, iS, miss, k)
                z[j] = zf
                P[j] = Pf
                write_step(outs, w, obase[j] + t * C, zf, Pf, iPf, zp, Pp, iPp, h, m, S, ll, miss, k)
