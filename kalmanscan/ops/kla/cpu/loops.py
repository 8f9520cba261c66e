"""The compiled loops of the KLA scan's ``"cpu"`` backend (:mod:`kalmanscan.ops.kla.cpu`), in numba.

Imported on the first call of that backend, so ``import kalmanscan`` neither imports numba nor
compiles anything; each loop compiles on its first call per dtype and is cached on disk
(``cache=True``).

Layout. Inputs are C-contiguous arrays in the compute dtype: ``v``, ``lam_v`` ``(B, L, M)``;
``k``, ``q`` ``(B, L, S)``; ``decay``, ``noise`` ``(M, S)``; the initial variance and mean
``(B, M, S)``. A task is one batch row and a block of at most :data:`BLOCK` consecutive channels;
tasks run in parallel (``prange``), each holding its block's state as ``(S, BLOCK)`` arrays
(channels innermost: the vector lanes; a partial last block pads its lanes with inert filters) and
walking time sequentially. The checkpoints are ``(B, chunks, S, M)``.

Recursion, in mean form (docs/math.md §7 with ``var = 1 / lam``, ``mu = eta / lam``; the form of
:func:`kalmanscan.ops.kla.recurrent.kla_step`, which never overflows): per token and filter ``(m, s)``

    phi = lam_v k^2,   b = lam_v v k,   P = decay^2 var + noise,   r = 1 / (1 + phi P)
    var <- P r,   mu <- (decay mu + P b) r
    y[m] = sum_s q mu,   y_var[m] = sum_s q^2 var

The transpose through ``P`` is written as ``d var / d P = r^2`` and ``d mu / d P = (b - phi decay
mu_prev) r^2``, not as the sums ``r - phi P r^2`` and ``b r - phi U r^2`` their derivation gives:
where ``phi P >> 1`` (a large initial variance, ``1e12``) those subtract two nearly equal terms
and lost the initial state's gradient (0, or ``1e4`` against ``-3.19``, in float32).

The backward recomputes each chunk of ``chunk`` tokens from its checkpoint, keeping the state
before every token, and walks it in reverse with the scalar adjoints ``gvar``, ``gmu`` of every
filter (the exact transpose of the lines above). Sums over ``s`` (``lam_v``, ``v`` gradients) stay
in the task; sums over ``m`` (``k``, ``q``) are one partial per task, ``(B, blocks, L, S)``, and
the ``decay``, ``noise`` gradients one per batch row, ``(B, M, S)``: the caller adds them up.

Arithmetic is in the arrays' dtype (``consts`` holds 1 and 2 in it: a Python float literal would
promote float32 to float64), with ``fastmath`` limited to reassociating sums and contracting
multiply-adds (:data:`FAST`), so the compiler vectorises the channel loops and their sums over
``m``. Each task's operations depend only on :data:`BLOCK`, not on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kalmanscan.ops.cpu_threads import PARALLEL

BLOCK = 32                    # channels per task (vector lanes)
FAST = {"reassoc", "contract"}
ONE, TWO = range(2)           # entries of consts


def constants(dtype: np.dtype | type) -> np.ndarray:
    """The array ``consts`` of the loops in ``dtype``."""
    return np.array([1.0, 2.0], dtype=dtype)


@njit(inline="always", fastmath=FAST)
def block_params(decay: np.ndarray, noise: np.ndarray, m0: int, W: int,
                 one: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(decay, decay^2, noise)`` of channels ``m0 .. m0 + W - 1`` as ``(S, BLOCK)`` arrays, the
    lanes past ``W`` inert (``decay = one``, ``noise = 0``)."""
    S = decay.shape[1]
    a = np.empty((S, BLOCK), decay.dtype)
    a2 = np.empty_like(a)
    n = np.empty_like(a)
    for s in range(S):
        for i in range(BLOCK):
            a[s, i] = decay[m0 + i, s] if i < W else one
            a2[s, i] = a[s, i] * a[s, i]
            n[s, i] = noise[m0 + i, s] if i < W else one - one
    return a, a2, n


@njit(inline="always", fastmath=FAST)
def load_state(x: np.ndarray, b: int, m0: int, W: int, fill: float) -> np.ndarray:
    """``x[b, m0 : m0 + W, :]`` of a ``(B, M, S)`` array, transposed to ``(S, BLOCK)`` (a copy; the
    lanes past ``W`` hold ``fill``)."""
    S = x.shape[2]
    out = np.empty((S, BLOCK), x.dtype)
    for s in range(S):
        for i in range(BLOCK):
            out[s, i] = x[b, m0 + i, s] if i < W else fill
    return out


@njit(inline="always", fastmath=FAST)
def store_state(out: np.ndarray, x: np.ndarray, b: int, m0: int, W: int) -> None:
    """``out[b, m0 : m0 + W, :] = x[:, :W].T`` for ``x`` of shape ``(S, BLOCK)``."""
    for s in range(x.shape[0]):
        for i in range(W):
            out[b, m0 + i, s] = x[s, i]


@njit(inline="always", fastmath=FAST)
def token(v: np.ndarray, lam_v: np.ndarray, b: int, t: int, m0: int, W: int, lv: np.ndarray, bv: np.ndarray) -> None:
    """``lam_v`` and ``b / k = lam_v v`` of token ``t``'s channels into ``lv``, ``bv`` (``(BLOCK,)``;
    the lanes past ``W`` keep the zeros they were made with)."""
    for i in range(W):
        lv[i] = lam_v[b, t, m0 + i]
        bv[i] = lv[i] * v[b, t, m0 + i]


@njit(inline="always", fastmath=FAST)
def step(var: np.ndarray, mu: np.ndarray, a: np.ndarray, a2: np.ndarray, n: np.ndarray, lv: np.ndarray,
         bv: np.ndarray, k: np.ndarray, q: np.ndarray, b: int, t: int, ay: np.ndarray, av: np.ndarray,
         one: float) -> None:
    """Token ``t`` of the block's ``(S, BLOCK)`` filters, in place; its ``y`` and ``y_var`` into
    ``ay``, ``av`` (``(BLOCK,)``). The lane loops run over all ``BLOCK`` lanes (a constant trip
    count the compiler unrolls into whole vectors; inert lanes stay finite)."""
    ay[:] = one - one
    av[:] = one - one
    for s in range(var.shape[0]):
        ks = k[b, t, s]
        qs = q[b, t, s]
        k2 = ks * ks
        q2 = qs * qs
        for i in range(BLOCK):
            P = a2[s, i] * var[s, i] + n[s, i]
            r = one / (one + lv[i] * k2 * P)
            vn = P * r
            mn = (a[s, i] * mu[s, i] + P * (bv[i] * ks)) * r
            var[s, i] = vn
            mu[s, i] = mn
            ay[i] += qs * mn
            av[i] += q2 * vn


@njit(inline="always", fastmath=FAST)
def reset(var: np.ndarray, mu: np.ndarray, var0: np.ndarray, mu0: np.ndarray, d: int, m0: int, W: int) -> None:
    """The block's state, in place, set to row ``d`` of the initial ``var0``, ``mu0`` ``(N, M, S)``
    (a document's start; the lanes past ``W`` keep their inert values)."""
    for s in range(var.shape[0]):
        for i in range(W):
            var[s, i] = var0[d, m0 + i, s]
            mu[s, i] = mu0[d, m0 + i, s]


@njit(parallel=PARALLEL, cache=True, error_model="numpy", fastmath=FAST)
def forward(v: np.ndarray, lam_v: np.ndarray, k: np.ndarray, q: np.ndarray, decay: np.ndarray, noise: np.ndarray,
            var0: np.ndarray, mu0: np.ndarray, y: np.ndarray, y_var: np.ndarray, var_out: np.ndarray,
            mu_out: np.ndarray, ck_var: np.ndarray, ck_mu: np.ndarray, starts: np.ndarray, ends: np.ndarray,
            chunk: int, consts: np.ndarray) -> None:
    """The scan: ``y``, ``y_var`` ``(B, L, M)``, the final state into ``var_out``, ``mu_out``
    ``(B, M, S)``, and (where ``ck_var`` has a batch axis) the state at the start of every chunk of
    ``chunk`` tokens into ``ck_var``, ``ck_mu`` ``(B, chunks, S, M)``. Packed documents (``starts``
    and ``ends`` of length ``L``, else empty; ``B = 1``): the state is reset to row ``starts[t]`` of
    ``var0``, ``mu0`` before token ``t`` where that is ``>= 0``, and stored to row ``ends[t]`` of
    ``var_out``, ``mu_out`` after it."""
    B, L, M = v.shape
    nb = (M + BLOCK - 1) // BLOCK
    save = ck_var.shape[0] > 0
    docs = starts.shape[0] > 0
    one = consts[ONE]
    for task in prange(B * nb):
        b = task // nb
        m0 = (task % nb) * BLOCK
        W = min(BLOCK, M - m0)
        a, a2, n = block_params(decay, noise, m0, W, one)
        var = load_state(var0, b, m0, W, one)
        mu = load_state(mu0, b, m0, W, one - one)
        lv = np.zeros(BLOCK, v.dtype)
        bv = np.zeros_like(lv)
        ay = np.empty_like(lv)
        av = np.empty_like(lv)
        for t in range(L):
            if docs and starts[t] >= 0:
                reset(var, mu, var0, mu0, starts[t], m0, W)
            if save and t % chunk == 0:
                ck_var[b, t // chunk, :, m0:m0 + W] = var[:, :W]
                ck_mu[b, t // chunk, :, m0:m0 + W] = mu[:, :W]
            token(v, lam_v, b, t, m0, W, lv, bv)
            step(var, mu, a, a2, n, lv, bv, k, q, b, t, ay, av, one)
            for i in range(W):
                y[b, t, m0 + i] = ay[i]
                y_var[b, t, m0 + i] = av[i]
            if docs and ends[t] >= 0:
                store_state(var_out, var, ends[t], m0, W)
                store_state(mu_out, mu, ends[t], m0, W)
        if not docs:
            store_state(var_out, var, b, m0, W)
            store_state(mu_out, mu, b, m0, W)


@njit(parallel=PARALLEL, cache=True, error_model="numpy", fastmath=FAST)
def backward(v: np.ndarray, lam_v: np.ndarray, k: np.ndarray, q: np.ndarray, decay: np.ndarray, noise: np.ndarray,
             ck_var: np.ndarray, ck_mu: np.ndarray, gy: np.ndarray, gy_var: np.ndarray, g_var: np.ndarray,
             g_mu: np.ndarray, gv: np.ndarray, glam_v: np.ndarray, gk_part: np.ndarray, gq_part: np.ndarray,
             gdecay_part: np.ndarray, gnoise_part: np.ndarray, gvar0: np.ndarray, gmu0: np.ndarray,
             var0: np.ndarray, mu0: np.ndarray, starts: np.ndarray, ends: np.ndarray, chunk: int,
             consts: np.ndarray) -> None:
    """Gradients of the scan from the cotangents ``gy``, ``gy_var`` ``(B, L, M)`` and ``g_var``,
    ``g_mu`` ``(B, M, S)`` (of the final state): ``gv``, ``glam_v`` ``(B, L, M)``; partials
    ``gk_part``, ``gq_part`` ``(B, blocks, L, S)`` and ``gdecay_part``, ``gnoise_part``
    ``(B, M, S)``; the initial state's ``gvar0``, ``gmu0`` ``(B, M, S)``. Packed documents
    (:func:`forward`'s ``starts``, ``ends``; ``var0``, ``mu0`` the initial state, read only then):
    the recomputation resets as the forward did, the adjoints are set to row ``ends[t]`` of
    ``g_var``, ``g_mu`` before token ``t``'s reverse step and stored to row ``starts[t]`` of
    ``gvar0``, ``gmu0`` after it."""
    B, L, M = v.shape
    S = k.shape[2]
    nb = (M + BLOCK - 1) // BLOCK
    n_chunks = ck_var.shape[1]
    docs = starts.shape[0] > 0
    one = consts[ONE]
    two = consts[TWO]
    for task in prange(B * nb):
        b = task // nb
        mb = task % nb
        m0 = mb * BLOCK
        W = min(BLOCK, M - m0)
        a, a2, n = block_params(decay, noise, m0, W, one)
        gV = load_state(g_var, b, m0, W, one - one)
        gM = load_state(g_mu, b, m0, W, one - one)
        ga = np.zeros_like(gV)
        gn = np.zeros_like(gV)
        sv = np.empty((chunk, S, BLOCK), v.dtype)
        sm = np.empty_like(sv)
        var = np.ones((S, BLOCK), v.dtype)
        mu = np.zeros_like(var)
        lv = np.zeros(BLOCK, v.dtype)
        bv = np.zeros_like(lv)
        vv = np.zeros_like(lv)
        gyw = np.zeros_like(lv)
        gyvw = np.zeros_like(lv)
        acc_lv = np.empty_like(lv)
        acc_v = np.empty_like(lv)
        for cc in range(n_chunks):
            c = n_chunks - 1 - cc
            t0 = c * chunk
            t1 = min(t0 + chunk, L)
            var[:, :W] = ck_var[b, c, :, m0:m0 + W]
            mu[:, :W] = ck_mu[b, c, :, m0:m0 + W]
            for t in range(t0, t1):  # the chunk again, keeping the state before each token
                if docs and starts[t] >= 0:
                    reset(var, mu, var0, mu0, starts[t], m0, W)
                sv[t - t0] = var
                sm[t - t0] = mu
                token(v, lam_v, b, t, m0, W, lv, bv)
                step(var, mu, a, a2, n, lv, bv, k, q, b, t, acc_lv, acc_v, one)
            for t in range(t1 - 1, t0 - 1, -1):
                j = t - t0
                if docs and ends[t] >= 0:
                    reset(gV, gM, g_var, g_mu, ends[t], m0, W)
                token(v, lam_v, b, t, m0, W, lv, bv)
                acc_lv[:] = one - one
                acc_v[:] = one - one
                for i in range(W):
                    vv[i] = v[b, t, m0 + i]
                    gyw[i] = gy[b, t, m0 + i]
                    gyvw[i] = gy_var[b, t, m0 + i]
                for s in range(S):
                    ks = k[b, t, s]
                    qs = q[b, t, s]
                    k2 = ks * ks
                    q2 = qs * qs
                    gk_s = one - one
                    gq_s = one - one
                    for i in range(BLOCK):
                        vp = sv[j, s, i]
                        mp = sm[j, s, i]
                        A = a[s, i]
                        P = a2[s, i] * vp + n[s, i]
                        phi = lv[i] * k2
                        r = one / (one + phi * P)
                        bk = bv[i] * ks
                        U = A * mp + P * bk
                        gmn = gM[s, i] + gyw[i] * qs
                        gvn = gV[s, i] + gyvw[i] * q2
                        gq_s += gyw[i] * (U * r) + two * qs * gyvw[i] * (P * r)
                        gU = gmn * r
                        r2 = r * r
                        gd = -(gmn * U + gvn * P) * r2
                        gP = (gvn + gmn * (bk - phi * (A * mp))) * r2
                        gphi = gd * P
                        gbk = gU * P
                        ga[s, i] += gU * mp + two * A * vp * gP
                        gn[s, i] += gP
                        gM[s, i] = gU * A
                        gV[s, i] = gP * a2[s, i]
                        acc_lv[i] += gphi * k2 + gbk * vv[i] * ks
                        acc_v[i] += gbk * ks
                        gk_s += lv[i] * (two * ks * gphi + vv[i] * gbk)
                    gk_part[b, mb, t, s] = gk_s
                    gq_part[b, mb, t, s] = gq_s
                for i in range(W):
                    glam_v[b, t, m0 + i] = acc_lv[i]
                    gv[b, t, m0 + i] = acc_v[i] * lv[i]
                if docs and starts[t] >= 0:
                    store_state(gvar0, gV, starts[t], m0, W)
                    store_state(gmu0, gM, starts[t], m0, W)
        store_state(gdecay_part, ga, b, m0, W)
        store_state(gnoise_part, gn, b, m0, W)
        if not docs:
            store_state(gvar0, gV, b, m0, W)
            store_state(gmu0, gM, b, m0, W)
