"""Calibration diagnostics: is the filter's uncertainty honest? (``ks.diagnostics``)

The checks and scores live in :mod:`.calibration` (NEES, NIS, coverage, PIT, CRPS, log score and
the :func:`report` that gathers them), the law of the standardised state errors in
:mod:`.state_errors` and the plots in :mod:`.plot` (``ks.plot``, imported on first use: it needs
matplotlib)."""

from __future__ import annotations

from kalmanscan.diagnostics.calibration import (KS_EXACT, LEVELS, CalibrationReport, coverage, crps, effective_dof,
                                                inside, log_score, nees, nis, numpy_post, pit, predictive_coverage,
                                                quadratic_form_check, report, scored)

__all__ = ["numpy_post", "scored", "inside", "effective_dof", "nees", "nis", "pit", "crps", "log_score", "coverage",
           "predictive_coverage", "quadratic_form_check", "report", "CalibrationReport", "LEVELS",
           "KS_EXACT"]
