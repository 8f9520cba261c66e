"""Calibration diagnostics: is the filter's uncertainty honest? (``ks.diagnostics``)

Every function takes a :class:`~kalmanscan.Posterior` (NumPy or torch; tensors are detached and
moved to the host) and arrays broadcasting to its ``(..., T, C)`` shape, and returns NumPy float64.
NaN in ``y`` or ``truth`` gives NaN in the elementwise scores and is left out of every average.
So do the steps of a diffuse prior (``init_var = inf``) whose variance is infinite: the predictive
law of each channel's first observation (``post.n_diffuse``; the log-likelihood leaves them out
too), and the posterior before it. Neither is a proper law to score against. Distributions and
tests are those of ``scipy.stats``.

Scores against observations use the one-step predictive law ``y_t | y_1..y_{t-1} ~ N(m_t, S_t)``
(``post.pred_obs_mean``, ``post.pred_obs_var``); scores against the true state use the posterior
``N(mu_t, P_t)`` (``post.mean``, ``post.var``: filtered or smoothed). Under the model:

- ``nis = (y - m)^2 / S`` is chi-square(1) and independent over time (innovations are white);
- ``nees = (x - mu)^2 / P`` is chi-square(1) at each step, but correlated over time;
- ``pit = Phi((y - m) / sqrt(S))`` is uniform on (0, 1), independent over time;
- a central ``level`` interval covers ``y`` (or ``x``) with probability ``level``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


import numpy as np
from scipy import special, stats

from kalmanscan.diagnostics import state_errors
from kalmanscan.inference.frames import columns, is_pandas
from kalmanscan.types import ArrayLike

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior


__all__ = ["numpy_post", "scored", "inside", "effective_dof", "nees", "nis", "pit", "crps", "log_score", "coverage",
           "predictive_coverage", "quadratic_form_check",
           "report", "CalibrationReport", "LEVELS"]

LEVELS = (0.5, 0.8, 0.9, 0.95)
KS_EXACT = 10_000  # observed values up to which the PIT test's p-value is exact


def numpy_post(post: Posterior) -> Posterior:
    """``post`` with NumPy arrays (a torch-backed or pandas :class:`~kalmanscan.Posterior` converted)."""
    return post.to_numpy() if hasattr(post.mean, "detach") or getattr(post, "frame", None) is not None else post


def _aligned(name, x, shape):
    if is_pandas(x):  # a Series is one channel, as ks.filter reads it
        x = columns(x)
    arr = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    try:
        return np.broadcast_to(arr.astype(np.float64), shape)
    except ValueError:
        raise ValueError(f"{name} of shape {arr.shape} does not broadcast to the posterior's {shape}") from None


def scored(x: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``x`` with NaN where ``var`` is infinite (a diffuse prior's improper law: not scored)."""
    return np.where(np.isinf(var), np.nan, x)


def _predictive(post, y):
    post = numpy_post(post)
    m = np.asarray(post.pred_obs_mean, np.float64)
    s2 = np.asarray(post.pred_obs_var, np.float64)
    return scored(_aligned("y", y, m.shape), s2), m, s2


def _state(post, truth):
    post = numpy_post(post)
    mu = np.asarray(post.mean, np.float64)
    var = np.asarray(post.var, np.float64)
    return scored(_aligned("truth", truth, mu.shape), var), mu, var


def nees(post: Posterior, truth: ArrayLike) -> np.ndarray:
    """Normalised estimation error squared ``(truth - mean)^2 / var``, shape ``(..., T, C)``."""
    x, mu, var = _state(post, truth)
    return (x - mu) ** 2 / var


def _z(y, m, s2):
    """The standardised innovation ``(y - m) / sqrt(S)``."""
    return (y - m) / np.sqrt(s2)


def _pit(z):
    return special.ndtr(z)  # the standard normal CDF (scipy.stats.norm.cdf's own, without its checks)


def _crps(z, s2):
    phi = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return np.sqrt(s2) * (z * (2 * special.ndtr(z) - 1) + 2 * phi - 1 / math.sqrt(math.pi))


def _log_score(z, s2):
    return 0.5 * (np.log(2 * math.pi * s2) + z * z)


def nis(post: Posterior, y: ArrayLike) -> np.ndarray:
    """Normalised innovation squared ``(y - pred_obs_mean)^2 / pred_obs_var``; NaN where missing."""
    y, m, s2 = _predictive(post, y)
    return (y - m) ** 2 / s2


def pit(post: Posterior, y: ArrayLike) -> np.ndarray:
    """Probability integral transform ``Phi((y - m) / sqrt(S))`` of ``y`` under its one-step predictive."""
    return _pit(_z(*_predictive(post, y)))


def crps(post: Posterior, y: ArrayLike) -> np.ndarray:
    """Continuous ranked probability score of the Gaussian one-step predictive (lower is better).

    Closed form with ``z = (y - m) / s``: ``s (z (2 Phi(z) - 1) + 2 phi(z) - 1 / sqrt(pi))``, in
    the units of ``y``.
    """
    y, m, s2 = _predictive(post, y)
    return _crps(_z(y, m, s2), s2)


def log_score(post: Posterior, y: ArrayLike) -> np.ndarray:
    """Negative log predictive density ``-log N(y; m, S)`` (lower is better); NaN where missing.

    Where ``y`` is observed it equals ``-post.logliks``.
    """
    y, m, s2 = _predictive(post, y)
    return _log_score(_z(y, m, s2), s2)


def inside(mean: np.ndarray, var: np.ndarray, x: np.ndarray, level: ArrayLike,
           axis: int | tuple[int, ...] | None) -> np.ndarray:
    """Fraction of ``x`` inside the central ``level`` band(s) of ``N(mean, var)``, over ``axis``
    (NaN ``x`` ignored); ``level`` a scalar or an array of levels in ``(0, 1)``."""
    levels = np.asarray(level, dtype=np.float64)
    if np.any(~(levels > 0) | ~(levels < 1)):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    z = stats.norm.ppf(0.5 + levels / 2).reshape(levels.shape + (1,) * mean.ndim)
    hit = np.abs(x - mean) <= z * np.sqrt(var)
    frac = np.where(np.isnan(x), np.nan, hit.astype(np.float64))
    axes = range(mean.ndim) if axis is None else ((axis,) if np.isscalar(axis) else axis)
    return np.nanmean(frac, axis=tuple((a % mean.ndim) + levels.ndim for a in axes))


def coverage(post: Posterior, truth: ArrayLike, level: ArrayLike = 0.9, *,
             axis: int | tuple[int, ...] | None = None) -> float | np.ndarray:
    """Fraction of ``truth`` inside the central ``level`` credible interval ``mean ± z sqrt(var)``.

    ``level`` is a number or a sequence (its shape leads the result). ``axis=None`` averages over
    everything (a float per level); ``axis=-2`` gives the fraction per series over time.
    """
    x, mu, var = _state(post, truth)
    out = inside(mu, var, x, level, axis)
    return float(out) if np.ndim(out) == 0 else out


def predictive_coverage(post: Posterior, y: ArrayLike, level: ArrayLike = 0.9, *,
                        axis: int | tuple[int, ...] | None = None) -> float | np.ndarray:
    """Fraction of observed ``y`` inside the central ``level`` interval of its one-step predictive."""
    y, m, s2 = _predictive(post, y)
    out = inside(m, s2, y, level, axis)
    return float(out) if np.ndim(out) == 0 else out


@dataclass
class CalibrationReport:
    """Summary of the calibration checks of :func:`report` (see its docstring for the tests).

    Bands are central intervals at the per-check level ``alpha / n_checks`` (Bonferroni), so the
    verdict's false-alarm rate on data from the model is at most ``alpha``.
    """

    calibrated: bool
    reasons: list
    alpha: float
    n_checks: int
    n_obs: int
    n_missing: int
    mean_nis: float
    nis_band: tuple
    nis_pvalue: float
    pit_ks: float
    pit_pvalue: float
    pit_mean: float
    pit_var: float
    coverage: dict
    coverage_bands: dict
    mean_crps: float
    mean_log_score: float
    mean_nees: float | None = None
    nees_band: tuple | None = None
    nees_pvalue: float | None = None
    nees_dof: float | None = None
    state_coverage: dict | None = field(default=None)
    n_diffuse: int = 0

    def __repr__(self) -> str:
        verdict = "calibrated" if self.calibrated else "NOT calibrated"
        lines = [f"CalibrationReport: {verdict} (alpha = {self.alpha:g} over {self.n_checks} checks)",
                 f"  {'observations':<24}{self.n_obs} ({self.n_missing} missing"
                 + (f", {self.n_diffuse} diffuse, not scored)" if self.n_diffuse else ")")]

        def row(name, value, detail, ok):
            lines.append(f"  {name:<24}{value:<10}{detail:<28}{'ok' if ok else 'FAIL'}")

        def band_row(name, value, band):
            row(name, f"{value:.4g}", f"band [{band[0]:.4g}, {band[1]:.4g}]", _inside_band(value, band))

        band_row("mean NIS", self.mean_nis, self.nis_band)
        row("PIT uniformity (KS)", f"D={self.pit_ks:.3g}", f"p = {self.pit_pvalue:.3g}",
            self.pit_pvalue >= self.alpha / self.n_checks)
        for lvl, c in self.coverage.items():
            band_row(f"coverage of y at {lvl:g}", c, self.coverage_bands[lvl])
        if self.mean_nees is not None:
            band_row(f"mean NEES (dof {self.nees_dof:.0f})", self.mean_nees, self.nees_band)
            cov = ", ".join(f"{lvl:g}: {c:.3f}" for lvl, c in self.state_coverage.items())
            lines.append(f"  {'coverage of the state':<24}{cov}")
        lines.append(f"  {'mean CRPS':<24}{self.mean_crps:.4g}")
        lines.append(f"  {'mean log score':<24}{self.mean_log_score:.4g}")
        if self.reasons:
            lines.append("Reasons:")
            lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def _inside_band(value, band):
    return band[0] <= value <= band[1]


def quadratic_form_check(mean: float, k: tuple, a: float) -> tuple[tuple, float]:
    """The mean ``mean`` of ``k[0]`` correlated chi-square(1) terms, with cumulants ``k = (k1, k2, k3)`` of
    their sum, against the scaled and shifted ``c chi2(nu) + b`` of the same three cumulants
    (Pearson's approximation; ``nu = 8 k2^3 / k3^2``): ``(band, two-sided p)``."""
    k1, k2, k3 = k
    nu = 8 * k2**3 / k3**2
    c = math.sqrt(k2 / (2 * nu))
    b = k1 - c * nu
    band = tuple((c * float(v) + b) / k1 for v in stats.chi2.ppf([a / 2, 1 - a / 2], nu))
    t = (mean * k1 - b) / c
    p = float(min(1.0, 2 * min(stats.chi2.cdf(t, nu), stats.chi2.sf(t, nu))))
    return band, p


def _chi2_check(mean, dof, a):
    """A mean of ``dof`` chi-square(1) terms against ``chi2(dof) / dof``: ``(band, two-sided p)``."""
    band = tuple(float(v) / dof for v in stats.chi2.ppf([a / 2, 1 - a / 2], dof))
    total = mean * dof
    p = float(min(1.0, 2 * min(stats.chi2.cdf(total, dof), stats.chi2.sf(total, dof))))
    return band, p


def effective_dof(post: Posterior, truth: ArrayLike) -> float:
    """Effective count of independent chi-square(1) terms in the sum of :func:`nees` over the
    finite steps: ``2 k1^2 / k2`` with ``k1, k2`` the sum's mean and variance under the posterior's
    own model (:mod:`kalmanscan.diagnostics.state_errors`: the errors are correlated in time)."""
    post = numpy_post(post)
    k = state_errors.cumulants(state_errors.links(post), np.isfinite(nees(post, truth)))
    return state_errors.effective_count(k[0], k[1])


def report(post: Posterior, y: ArrayLike, truth: ArrayLike | None = None, *, levels: ArrayLike = LEVELS,
           alpha: float = 0.05) -> CalibrationReport:
    """Check the calibration of a filter (or smoother) run over ``y``; returns a :class:`CalibrationReport`.

    Checks, each at level ``alpha / n_checks``:

    - mean NIS against ``chi2(n) / n`` (``n`` observed values; innovations are independent);
    - uniformity of the PIT values (``scipy.stats.kstest`` against U(0, 1); its p-value exact up
      to :data:`KS_EXACT` values, from Kolmogorov's limit law above, which agrees to about 2%
      there at a tenth of the cost);
    - coverage of ``y`` by each central predictive interval in ``levels`` (binomial test);
    - with ``truth`` (the latent state, ``(..., T, C)``): mean NEES against its law under the
      model. The errors are correlated in time, as a Gauss-Markov chain whose correlations the
      posterior gives (:mod:`kalmanscan.diagnostics.state_errors`); the sum of squares is matched to a scaled,
      shifted chi-square by its first three cumulants. ``nees_dof`` is its effective count of
      independent terms (the same mean and variance).

    ``calibrated`` is true when every check passes; ``reasons`` says which failed and which way:
    under-dispersed (over-confident: variances too small) or over-dispersed (under-confident), or
    biased. The report also gives the mean CRPS and log score, and the state coverage.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    levels = tuple(float(v) for v in np.atleast_1d(levels))
    if any(not 0 < v < 1 for v in levels):
        raise ValueError(f"levels must be in (0, 1), got {levels}")
    post = numpy_post(post)
    _check_finite(post, y, truth)
    y_a, m, s2 = _predictive(post, y)  # every score below from these arrays: one pass each
    z = _z(y_a, m, s2)
    seen = ~np.isnan(y_a)
    n = int(seen.sum())
    n_missing = int(np.isnan(_aligned("y", y, y_a.shape)).sum())  # y_a is NaN at diffuse steps too
    if n < 2:
        raise ValueError(f"y must have at least 2 observed values, got {n}")
    n_checks = 2 + len(levels) + (truth is not None)
    a = alpha / n_checks
    reasons = []

    mean_nis = float(np.mean(z[seen] ** 2))
    nis_band, nis_p = _chi2_check(mean_nis, n, a)
    if mean_nis > nis_band[1]:
        reasons.append(f"mean NIS {mean_nis:.3g} is above its band [{nis_band[0]:.3g}, {nis_band[1]:.3g}]: "
                       "innovations are larger than the predictive variance says; under-dispersed "
                       "(over-confident: obs_var or sigma too small)")
    elif mean_nis < nis_band[0]:
        reasons.append(f"mean NIS {mean_nis:.3g} is below its band [{nis_band[0]:.3g}, {nis_band[1]:.3g}]: "
                       "innovations are smaller than the predictive variance says; over-dispersed "
                       "(under-confident: obs_var or sigma too large)")

    u = _pit(z[seen])
    ks = stats.kstest(u, "uniform", method="exact" if n <= KS_EXACT else "asymp")
    pit_mean, pit_var = float(u.mean()), float(u.var())
    if ks.pvalue < a:
        reasons.append(f"PIT is not uniform (KS D = {ks.statistic:.3g}, p = {ks.pvalue:.2g}): "
                       + _pit_shape(pit_mean, pit_var, n))

    cov, bands = {}, {}
    covered = inside(m, s2, y_a, levels, None)  # every level at once
    for lvl, c in zip(levels, covered.tolist()):
        lo, hi = stats.binom.interval(1 - a, n, lvl)
        cov[lvl], bands[lvl] = c, (lo / n, hi / n)
        p = stats.binomtest(int(round(c * n)), n, lvl).pvalue
        if p < a:
            way = "too narrow: under-dispersed" if c < lvl else "too wide: over-dispersed"
            reasons.append(f"{lvl:.0%} predictive intervals cover {c:.1%} of y (binomial p = {p:.2g}): {way}")

    extra = {}
    if truth is not None:
        x, mu, var = _state(post, truth)
        err = (x - mu) / np.sqrt(var)
        e2 = err[np.isfinite(err)] ** 2
        if e2.size < 2:
            raise ValueError("truth must have at least 2 finite values")
        k = state_errors.cumulants(state_errors.links(post), np.isfinite(err))
        dof = state_errors.effective_count(k[0], k[1])
        mean_nees = float(e2.mean())
        band, p = quadratic_form_check(mean_nees, k, a)
        extra = dict(mean_nees=mean_nees, nees_band=band, nees_pvalue=p, nees_dof=dof,
                     state_coverage={lvl: coverage(post, truth, lvl) for lvl in levels})
        if mean_nees > band[1]:
            reasons.append(f"mean NEES {mean_nees:.3g} is above its band [{band[0]:.3g}, {band[1]:.3g}]: "
                           "the state is further from the truth than its variance says; over-confident")
        elif mean_nees < band[0]:
            reasons.append(f"mean NEES {mean_nees:.3g} is below its band [{band[0]:.3g}, {band[1]:.3g}]: "
                           "the state variance is larger than its errors; under-confident")

    return CalibrationReport(
        calibrated=not reasons, reasons=reasons, alpha=alpha, n_checks=n_checks, n_obs=n,
        n_missing=n_missing, n_diffuse=int(y_a.size - n - n_missing), mean_nis=mean_nis, nis_band=nis_band,
        nis_pvalue=nis_p,
        pit_ks=float(ks.statistic), pit_pvalue=float(ks.pvalue), pit_mean=pit_mean, pit_var=pit_var,
        coverage=cov, coverage_bands=bands, mean_crps=float(np.mean(_crps(z[seen], s2[seen]))),
        mean_log_score=float(np.mean(_log_score(z[seen], s2[seen]))), **extra)


def _check_finite(post, y, truth):
    """``ValueError`` naming an infinite value of ``y`` or ``truth``, or a NaN or infinite moment
    of ``post`` where it would be scored (an observed ``y``, a finite ``truth``): a result that is
    not finite cannot be judged, and its scores would blame the intervals for it. An infinite
    variance where the prior was diffuse is the improper law that is not scored."""
    pairs = [("y", y, ("pred_obs_mean", "pred_obs_var"))]
    if truth is not None:
        pairs.append(("truth", truth, ("mean", "var")))
    for name, x, (mean, var) in pairs:
        m = np.asarray(getattr(post, mean), np.float64)
        s2 = np.asarray(getattr(post, var), np.float64)
        x = _aligned(name, x, m.shape)
        _name_first(name, np.isinf(x), "an infinite value", "missing values are NaN")
        scored = ~np.isnan(x) & ~(np.isposinf(s2) & ~np.isnan(m))
        for moment, values in ((mean, m), (var, s2)):
            _name_first(f"post.{moment}", scored & ~np.isfinite(values), "a NaN or infinite value where "
                        f"{name} is scored", "the filter's result is not finite, so its calibration cannot be "
                        "judged; check the parameters' scale and the filter's warnings")


def _name_first(name, bad, what, hint):
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} has {what} at {int(bad.sum())} position(s), the first at index {at}: {hint}")


def _pit_shape(mean, var, n):
    """Describe a non-uniform PIT by its mean (bias) and variance (dispersion) z-scores."""
    z_mean = (mean - 0.5) / math.sqrt(1 / 12 / n)
    z_var = (var - 1 / 12) / math.sqrt(1 / 180 / n)
    parts = []
    if abs(z_var) >= 3 or abs(z_var) >= abs(z_mean):
        parts.append(f"variance {var:.3f} vs 1/12 = 0.083: " + (
            "U-shaped histogram, under-dispersed (over-confident)" if z_var > 0 else
            "hump-shaped histogram, over-dispersed (under-confident)"))
    if abs(z_mean) >= 3 or abs(z_mean) > abs(z_var):
        parts.append(f"mean {mean:.3f} vs 0.5: observations fall " + (
            "above the predictive mean more often: forecasts biased low" if z_mean > 0 else
            "below the predictive mean more often: forecasts biased high"))
    return "; ".join(parts)
