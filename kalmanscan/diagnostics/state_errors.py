"""The law of a posterior's standardised state errors under its own model, for the NEES check.

For the filter, the error ``e_t = x_t - mu_t`` follows ``e_t = (1 - K_t h_t)(a_t e_{t-1} + w_t) -
K_t v_t`` with noises independent of the past, and for the smoother the errors are the posterior
``p(x_1..x_T | y)``'s deviations, a Gauss-Markov chain whose lag-one covariance is
``G_t P^s_{t+1}`` (``G_t`` the smoother's gain). Either way the standardised errors
``z_t = e_t / sqrt(P_t)`` form a Gaussian Markov chain, so ``corr(z_s, z_t)`` is the product of the
lag-one correlations between them, and both cases have the same link

    c_t = corr(z_{t-1}, z_t) = f_t sqrt(P_t / P_{t-1}),    f_t = a_t P^f_{t-1} / P^pred_t

with ``f_t`` the filter's forget gate (:meth:`Posterior.gates`), ``P`` the posterior's variance
(filtered or smoothed) and ``P^f`` the filter's. A link touching an infinite variance (a diffuse
prior's improper steps) is 0: the errors after it do not depend on those before.

The sum of squares ``Q = sum_i z_i^2`` over the scored steps ``i`` (finite error) of a chain with
correlation matrix ``R`` has cumulants ``k_r = 2^(r-1) (r-1)! tr(R^r)``. With ``rho_ij`` the
products of links, ``tr(R^2) = n + 2 S2`` and ``tr(R^3) = n + 6 S2 + 6 S3`` where
``S2 = sum_{i<j} rho_ij^2`` and ``S3 = sum_{i<j<k} rho_ij^2 rho_jk^2`` (a chain's
``rho_ik = rho_ij rho_jk``). Both follow from two first-order recurrences over time,

    g_t = c_t^2 (g_{t-1} + w_{t-1})    (sum over earlier scored steps of rho^2)
    b_t = c_{t+1}^2 (b_{t+1} + w_{t+1})  (the same over later ones)

``S2 = sum_t w_t g_t`` and ``S3 = sum_t w_t g_t b_t`` (``w_t = 1`` where scored), run as affine
scans (:func:`kalmanscan.model.scan.associative_scan`, float64). Series are independent, so their
cumulants add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kalmanscan.model.scan import associative_scan

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior

__all__ = ["links", "cumulants", "effective_count"]


def links(post: Posterior) -> np.ndarray:
    """Lag-one correlations ``c_t`` of the standardised state errors, float64 ``(..., T, C)``
    (``c_0 = 0``); ``post`` a NumPy :class:`~kalmanscan.Posterior` (filtered or smoothed)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        forget = np.asarray(post.gates()[0], np.float64)
        var = np.asarray(post.var, np.float64)
        c = np.zeros(np.broadcast_shapes(forget.shape, var.shape))
        c[..., 1:, :] = forget[..., 1:, :] * np.sqrt(var[..., 1:, :] / var[..., :-1, :])
    return np.where(np.isfinite(c), c, 0.0)


def _affine(coef, add, reverse=False):
    """``s_t = coef_t s_{t-1} + add_t`` from ``s_{-1} = 0`` along axis -2 (``reverse``: ``s_t =
    coef_t s_{t+1} + add_t`` from the end)."""
    def combine(earlier, later):
        return later[0] * earlier[0], later[0] * earlier[1] + later[1]

    elems = (torch.from_numpy(coef), torch.from_numpy(add))
    return associative_scan(combine, elems, dim=-2, reverse=reverse)[1].numpy()


def cumulants(c: np.ndarray, scored: np.ndarray) -> tuple[float, float, float]:
    """The first three cumulants of ``Q = sum z_t^2`` over the steps where ``scored`` is true, for
    standardised Gaussian errors chained by the lag-one correlations ``c`` (both ``(..., T, C)``)."""
    c2 = np.array(np.broadcast_to(c * c, scored.shape), dtype=np.float64)
    w = scored.astype(np.float64)
    if c2.shape[-2] == 0:
        return 0.0, 0.0, 0.0
    prev = np.zeros_like(w)
    prev[..., 1:, :] = w[..., :-1, :]
    g = _affine(c2, c2 * prev)
    nxt_c2 = np.zeros_like(c2)
    nxt_c2[..., :-1, :] = c2[..., 1:, :]
    nxt = np.zeros_like(w)
    nxt[..., :-1, :] = w[..., 1:, :]
    b = _affine(nxt_c2, nxt_c2 * nxt, reverse=True)
    n = float(w.sum())
    s2 = float((w * g).sum())
    s3 = float((w * g * b).sum())
    return n, 2 * (n + 2 * s2), 8 * (n + 6 * s2 + 6 * s3)


def effective_count(k1: float, k2: float) -> float:
    """Independent chi-square(1) terms with the same mean and variance: ``2 k1^2 / k2`` (0 for an
    empty sum)."""
    return 2 * k1 * k1 / k2 if k2 > 0 else 0.0
