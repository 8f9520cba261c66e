"""The compiled forward loops of the ``"cpu"`` backend (:mod:`kalmanscan.ops.filter.cpu`), in
numba, and what the other loop modules share (:mod:`~kalmanscan.ops.filter.cpu.adjoint`, the
filter's reverse recursion; :mod:`~kalmanscan.ops.filter.cpu.rts`, the smoother).

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
Range: no intermediate is a product of two variances (``P = Pp (R / S)``, a variance times a
ratio; the adjoints divide a precision's cotangent by ``P`` twice rather than by ``P^2``), so the
recursion is scale-equivariant in floating point as far as the variances themselves are
representable: ``y, sigma, mean -> c y, c sigma, c mean`` and ``obs_var, init_var -> c^2 obs_var,
c^2 init_var`` scale every intermediate by a power of ``c`` of at most 2 (tests/test_scale.py).
The variance terms of a step (:func:`variance_terms`: two divisions and a logarithm) depend on
the incoming variance, the parameters and whether ``y`` is missing, not on ``y``: where the
parameters are static they are reused while the incoming variance repeats (the Riccati recursion
reaches its fixed point in floating point), the same values, bit for bit, as recomputing them.
Both forward loops compute a step with the same two functions (:func:`variance_terms`,
:func:`mean_terms`; the static loop's vector steps, :func:`steady_run`, repeat the operations of
:func:`mean_terms` lane by lane), so they give the same bits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kalmanscan.ops.cpu_threads import PARALLEL

# Input order of the filter loops (columns of boff, entries of tstride, cstride).
Y, THETA, SIGMA, DT, OBS_VAR, MEAN, H, INIT_MEAN, INIT_VAR = range(9)
# Output order of the forward.
(O_MEAN, O_VAR, O_PREC, O_PMEAN, O_PVAR, O_PPREC, O_POMEAN, O_POVAR, O_LL, O_MISS, O_ZC) = range(11)
# Constants (consts[i]) in the compute dtype.
HALF, SIXTH, C24, TAYLOR, LOG2PI, ZERO, ONE, TWO, TINY = range(9)
# Cotangent order of the filter backward (the differentiable forward outputs).
N_COT = 9
# Adjoint order of the filter backward: per-step or per-series parameter adjoints.
G_A, G_Q, G_R, G_H, G_M = range(5)
# Smoother inputs.
S_MEAN, S_VAR, S_LEVEL, S_PVAR, S_DECAY, S_NOISE = range(6)
# Cached variance terms of the static loop (rows of each slot of its per-task cache).
(K_P, K_PP, K_S, K_IS, K_K, K_PF, K_LS, K_IPF, K_IPP) = range(9)
# ``llsum`` of the forward loops when no log-likelihood sum is wanted (never written).
NO_SUMS = np.zeros(0, np.float64)



def constants(dtype: np.dtype | type) -> np.ndarray:
    """The array ``consts`` of the loops in ``dtype``."""
    return np.array([0.5, 1.0 / 6.0, 24.0, 1e-4, math.log(2.0 * math.pi), 0.0, 1.0, 2.0, np.finfo(dtype).tiny],
                    dtype=dtype)


@njit(inline="always")
def discretize(theta: float, sigma: float, dt: float, k: np.ndarray) -> tuple[float, float]:
    """``(decay, noise)`` of :func:`kalmanscan.model.ou.discretize` (``method="ou"``), same operations."""
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
    Pf = Pp * (R * iS)
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
               Pp: float, iPp: float, h: float, m: float, S: float, ll: float, miss: bool, k: np.ndarray,
               sums: bool, acc: np.ndarray, j: int) -> None:
    """Write a step's outputs flagged in ``w`` (:func:`flags`) at element ``o``; with ``sums`` add
    its log-likelihood to lane ``j``'s float64 sum ``acc[j]``."""
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
    if sums:
        acc[j] += ll


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def filter_forward(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                   outs: tuple[np.ndarray, ...], write: np.ndarray, k: np.ndarray, T: int, C: int, W: int,
                   trans_step: bool, llsum: np.ndarray) -> None:
    """The filter over every series; writes the outputs flagged in ``write`` (see module doc).

    ``ins``: 9 input arrays (order ``Y .. INIT_VAR``); ``outs``: 11 output arrays (``O_MEAN ..
    O_ZC``, the last the centred filtered mean the backward reads), each ``(B T C,)`` where
    ``write`` is set, else a placeholder; ``llsum`` ``(B C,)`` float64: each series'
    log-likelihood summed over time (in order, in float64), or empty for no sums (:data:`NO_SUMS`: one
    compiled signature a dtype, not one for each of given, ``None`` and omitted). ``trans_step``:
    theta, sigma or dt vary along time (else decay and noise are computed once per series). Any
    parameter may vary along time; with every one static :func:`filter_static` is the faster loop
    (the same bits).
    """
    y_, th_, si_, dt_, R_, m_, h_, im_, iv_ = ins
    w = flags(write)
    sums = llsum.shape[0] > 0
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
        acc = np.zeros(n, np.float64)
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
                write_step(outs, w, obase[j] + t * C, zf, Pf, iPf, zp, Pp, iPp, h, m, S, ll, miss, k, sums, acc, j)
        if sums:
            for j in range(n):
                llsum[s0 + j] = acc[j]


@njit(inline="always")
def contiguous(base: np.ndarray, obase: np.ndarray, n: int, t_y: int) -> bool:
    """Whether the ``n`` lanes are adjacent elements of ``y`` and of the outputs (and ``y`` varies
    along time): then a converged step runs as :func:`steady_step`'s vector loops."""
    if t_y == 0:
        return False
    for j in range(n):
        if base[Y, j] != base[Y, 0] + j or obase[j] != obase[0] + j:
            return False
    return True


@njit(inline="always")
def slot(cache: np.ndarray, j: int, P: float) -> int:
    """The slot of lane ``j``'s cache holding the variance terms of incoming variance ``P``, or -1."""
    if P == cache[0, K_P, j]:
        return 0
    if P == cache[1, K_P, j]:
        return 1
    return -1


@njit(inline="always")
def periodic(cache: np.ndarray, j: int, P: float) -> bool:
    """Whether lane ``j``'s observed steps from incoming variance ``P`` on cycle within its cache with
    period 1 or 2: ``P`` and its successor have slots and the successor's successor has ``P``'s slot
    (the variance sits at its fixed point or alternates between two values, as the recursion does in
    floating point). The slots of the following steps then alternate by the parity of the step."""
    s = slot(cache, j, P)
    if s < 0:
        return False
    s2 = slot(cache, j, cache[s, K_PF, j])
    return s2 >= 0 and slot(cache, j, cache[s2, K_PF, j]) == s


@njit(inline="always")
def settle(cache: np.ndarray, P: np.ndarray, terms: np.ndarray, t: int, n: int) -> None:
    """Copy each lane's cached terms to ``terms[t % 2]`` for step ``t`` (incoming variance ``P``, every
    lane :func:`periodic`) and to ``terms[1 - t % 2]`` for step ``t + 1``: the terms of every later
    steady step by its parity."""
    for j in range(n):
        s = slot(cache, j, P[j])
        s2 = slot(cache, j, cache[s, K_PF, j])
        for r in range(cache.shape[1]):
            terms[t & 1, r, j] = cache[s, r, j]
            terms[1 - (t & 1), r, j] = cache[s2, r, j]


@njit(inline="always")
def put(out: np.ndarray, o: int, x: np.ndarray, n: int) -> None:
    """``out[o + j] = x[j]`` for the lanes ``j < n`` (unsigned ``o, n``, see :func:`steady_run`)."""
    for j in range(n):
        out[o + j] = x[j]


@njit(inline="always")
def put_term(out: np.ndarray, o: int, terms: np.ndarray, p: int, r: int, n: int) -> None:
    """``out[o + j] = terms[p, r, j]`` for the lanes ``j < n``: a cached variance term."""
    for j in range(n):
        out[o + j] = terms[p, r, j]


@njit(inline="always")
def put_mean(out: np.ndarray, o: int, x: np.ndarray, par: np.ndarray, n: int) -> None:
    """``out[o + j] = x[j] + m`` for the lanes ``j < n``: a centred mean plus the lane's OU mean."""
    for j in range(n):
        out[o + j] = x[j] + par[4, j]


@njit(inline="always")
def put_fill(out: np.ndarray, o: int, x: float, n: int) -> None:
    """``out[o + j] = x`` for the lanes ``j < n``."""
    for j in range(n):
        out[o + j] = x


@njit(inline="always")
def put_obs_mean(out: np.ndarray, o: int, zp: np.ndarray, par: np.ndarray, n: int) -> None:
    """``out[o + j] = h (zp[j] + m)`` for the lanes ``j < n``: the predicted observation."""
    for j in range(n):
        out[o + j] = par[3, j] * (zp[j] + par[4, j])


@njit(inline="always")
def put_loglik(out: np.ndarray, o: int, v: np.ndarray, terms: np.ndarray, p: int, mh: float, n: int) -> None:
    """``out[o + j] = -(log(2 pi) + log S + v^2 / S) / 2`` for the lanes ``j < n`` (``mh = -1/2``,
    the log terms and ``1/S`` cached in ``terms[p]``)."""
    for j in range(n):
        out[o + j] = mh * (terms[p, K_LS, j] + v[j] * v[j] * terms[p, K_IS, j])


@njit(inline="always")
def steady_run(y_: np.ndarray, y0: int, t_y: int, outs: tuple[np.ndarray, ...], w: tuple[bool, ...], o0: int, C: int,
               t: int, T: int, z: np.ndarray, P: np.ndarray, par: np.ndarray, terms: np.ndarray, zp: np.ndarray,
               v: np.ndarray, k: np.ndarray, sums: bool, acc: np.ndarray) -> int:
    """Steps ``t, t + 1, ..`` of a task whose lanes are all :func:`periodic`, each as loops over the
    lanes, one store each (``y`` of lane ``j`` at ``y0 + t t_y + j``, its outputs at ``o0 + t C + j``;
    ``terms[t % 2]`` the cached variance terms of step ``t``, from :func:`settle`): the operations
    of the per-lane step on the same terms, so the same bits. Stops before the first step where
    some lane's innovation is NaN (a missing ``y``; an infinite one may also land here), leaving
    ``z`` and ``P`` as that step's incoming state for the per-lane path; returns that step (or ``T``).

    Offsets are unsigned (no negative-index wraparound, so the compiler sees contiguous rows and
    vectorises the loops) and the steps loop here, not in the caller: the arrays are bound once, not
    reference-counted per step."""
    n = np.uint64(z.size)
    mh, zero = -k[HALF], k[ZERO]
    while t < T:
        p = np.uint64(t & 1)
        yt = np.uint64(y0 + t * t_y)
        o = np.uint64(o0 + t * C)
        bad = 0
        for j in range(n):
            zp[j] = par[0, j] * z[j]
        for j in range(n):
            v[j] = (y_[yt + j] - par[5, j]) - par[3, j] * zp[j]
            bad += v[j] != v[j]
        if bad:
            break
        for j in range(n):
            z[j] = zp[j] + terms[p, K_K, j] * v[j]
        if w[O_LL]:
            put_loglik(outs[O_LL], o, v, terms, p, mh, n)
        if sums:
            for j in range(n):
                acc[j] += mh * (terms[p, K_LS, j] + v[j] * v[j] * terms[p, K_IS, j])
        if w[O_MEAN]:
            put_mean(outs[O_MEAN], o, z, par, n)
        if w[O_PMEAN]:
            put_mean(outs[O_PMEAN], o, zp, par, n)
        if w[O_POMEAN]:
            put_obs_mean(outs[O_POMEAN], o, zp, par, n)
        if w[O_ZC]:
            put(outs[O_ZC], o, z, n)
        if w[O_VAR]:
            put_term(outs[O_VAR], o, terms, p, K_PF, n)
        if w[O_PREC]:
            put_term(outs[O_PREC], o, terms, p, K_IPF, n)
        if w[O_PVAR]:
            put_term(outs[O_PVAR], o, terms, p, K_PP, n)
        if w[O_PPREC]:
            put_term(outs[O_PPREC], o, terms, p, K_IPP, n)
        if w[O_POVAR]:
            put_term(outs[O_POVAR], o, terms, p, K_S, n)
        if w[O_MISS]:
            put_fill(outs[O_MISS], o, zero, n)
        t += 1
    p = np.uint64((t - 1) & 1)  # the last step's filtered variance: the incoming one of step t
    for j in range(n):
        P[j] = terms[p, K_PF, j]
    return t


@njit(parallel=PARALLEL, cache=True, error_model="numpy")
def filter_static(ins: tuple[np.ndarray, ...], boff: np.ndarray, tstride: np.ndarray, cstride: np.ndarray,
                  outs: tuple[np.ndarray, ...], write: np.ndarray, k: np.ndarray, T: int, C: int, W: int,
                  llsum: np.ndarray) -> None:
    """:func:`filter_forward` where only ``y`` varies along time (same arguments, same bits).

    Each lane's parameters are read once. An observed step whose incoming variance equals one of
    the two last computed ones reuses their variance terms (two slots per lane: in floating point
    the Riccati recursion ends at its fixed point or alternating between two neighbours, see the
    module doc), so once the variance has converged a step costs a few multiplications and the
    writes, no division or logarithm. Once every lane of a task cycles within its cache
    (:func:`periodic`; and its lanes are adjacent in memory), each lane's terms of even and odd
    steps are set aside (:func:`settle`) and the steps run as vector loops over the lanes
    (:func:`steady_run`) until a missing value sends a step back to the per-lane path.
    """
    y_, th_, si_, dt_, R_, m_, h_, im_, iv_ = ins
    w = flags(write)
    sums = llsum.shape[0] > 0
    t_y = tstride[Y]
    N = boff.shape[0] * C
    for task in prange((N + W - 1) // W):
        s0 = task * W
        n = min(W, N - s0)
        base, obase = lanes(boff, cstride, s0, n, T, C)
        vector = contiguous(base, obase, n, t_y)
        z = np.empty(n, k.dtype)
        P = np.empty(n, k.dtype)
        par = np.empty((6, n), k.dtype)  # decay, noise, obs_var, h, mean, h * mean
        cache = np.full((2, 9, n), np.nan, k.dtype)
        fresh = np.zeros(n, np.int64)  # the slot the next computed terms replace
        terms = np.empty((2, 9, n), k.dtype)  # a steady task's cached terms of even and odd steps
        zp_ = np.empty(n, k.dtype)  # steady_run's predicted means and innovations
        v_ = np.empty(n, k.dtype)
        acc = np.zeros(n, np.float64)  # the lanes' log-likelihood sums (llsum)
        for j in range(n):
            par[2, j] = R_[base[OBS_VAR, j]]
            par[3, j] = h_[base[H, j]]
            par[4, j] = m_[base[MEAN, j]]
            par[5, j] = par[3, j] * par[4, j]
            par[0, j], par[1, j] = discretize(th_[base[THETA, j]], si_[base[SIGMA, j]], dt_[base[DT, j]], k)
            z[j] = im_[base[INIT_MEAN, j]] - par[4, j]
            P[j] = iv_[base[INIT_VAR, j]]
        t = 0
        while t < T:
            steady = vector and t > 0
            for j in range(n):
                a, q, R, h, m = par[0, j], par[1, j], par[2, j], par[3, j], par[4, j]
                y = y_[base[Y, j] + t * t_y]
                miss = math.isnan(y)
                zp = z[j]
                Pj = P[j]
                Pp = Pj
                s = slot(cache, j, Pj) if t > 0 and not miss else -1
                if t > 0:
                    zp = a * zp
                if s >= 0:
                    Pp, S, iS, K = cache[s, K_PP, j], cache[s, K_S, j], cache[s, K_IS, j], cache[s, K_K, j]
                    Pf, lS, iPf, iPp = cache[s, K_PF, j], cache[s, K_LS, j], cache[s, K_IPF, j], cache[s, K_IPP, j]
                else:
                    if t > 0:
                        Pp = a * a * Pj + q
                    S, iS, K, Pf, lS, iPf, iPp = variance_terms(Pp, h, R, miss, k)
                    if t > 0 and not miss:
                        s = fresh[j]
                        fresh[j] = 1 - s
                        cache[s, K_P, j], cache[s, K_PP, j], cache[s, K_S, j], cache[s, K_IS, j] = Pj, Pp, S, iS
                        cache[s, K_K, j], cache[s, K_PF, j], cache[s, K_LS, j] = K, Pf, lS
                        cache[s, K_IPF, j], cache[s, K_IPP, j] = iPf, iPp
                zf, ll = mean_terms(y, zp, h, m, K, lS, iS, miss, k)
                z[j] = zf
                P[j] = Pf
                steady = steady and not miss and periodic(cache, j, Pf)
                write_step(outs, w, obase[j] + t * C, zf, Pf, iPf, zp, Pp, iPp, h, m, S, ll, miss, k, sums, acc, j)
            t += 1
            if steady and t < T:
                settle(cache, P, terms, t, n)
                t = steady_run(y_, base[Y, 0], t_y, outs, w, obase[0], C, t, T, z, P, par, terms, zp_, v_, k, sums, acc)
        if sums:
            for j in range(n):
                llsum[s0 + j] = acc[j]
