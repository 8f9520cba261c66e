"""Calibration checks of a trained model's KLA variance (issue 6, item 5), run by :mod:`evidence.train`.

Two questions about the last KLA layer of a model, on the task's test split:

* :func:`variance_calibration`: is the layer's propagated output variance ``y_var`` larger where
  the model's prediction is wrong? (AUROC of the variance as an error detector, beside the
  softmax confidence's.)
* :func:`filter_calibration`: are the layer's filters honest about what they observe? Each filter
  ``(m, s)`` predicts the next ``v[m]`` with a Gaussian law; the toolkit's diagnostics
  (:func:`kalmanscan.diagnostics.report`: NIS, PIT, interval coverage) test that law on the ``v``
  the trained layer produces, through :func:`kalmanscan.nn.layer_filters`.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import rankdata

from kalmanscan.diagnostics.calibration import report
from kalmanscan.nn import KLA, layer_filters

from .tasks import IGNORE

FILTER_CHECK_ELEMENTS = 2 ** 24   # at most this many (token, filter) pairs in the filter check
FILTER_CHECK_LEVELS = (0.5, 0.9)


def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and device.type == "cuda")


def auroc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """Area under the ROC curve of ``scores`` for the boolean labels ``positive`` (Mann-Whitney,
    ties as average ranks): the chance that a random positive scores above a random negative.
    ``None`` when either class is empty."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = rankdata(scores)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@torch.no_grad()
def variance_calibration(model, x_test, y_test, batch: int, device, amp: bool) -> dict | None:
    """Is the last KLA layer's output variance larger where the model errs? ``None`` without KLA.

    At every scored test position: ``var`` = the layer's propagated output variance ``y_var``
    averaged over channels, and whether the argmax prediction is wrong. Returns the error rate,
    the mean ``var`` at wrong and at correct positions, ``auroc_var`` (variance as a detector of
    errors; 0.5 = uninformative), the same within each position averaged over positions
    (``auroc_var_by_position``: removes the trend of both with position), and the softmax
    confidence's AUROC as the yardstick (``auroc_confidence``, score ``1 - max prob``); and
    ``filters``, :func:`filter_calibration` of the layer on the first test batch.
    """
    layers = [m for m in model.modules() if isinstance(m, KLA)]
    if not layers:
        return None
    captured, filters = [], []

    def hook(module, inputs, output):
        captured.append(module.forward(inputs[0], return_variance=True)[1].float().mean(-1))
        if not filters:
            filters.append(filter_calibration(module, inputs[0]))

    handle = layers[-1].register_forward_hook(hook)
    model.eval()
    var, wrong, unsure, pos = [], [], [], []
    try:
        for start in range(0, x_test.shape[0], batch):
            x = torch.from_numpy(x_test[start : start + batch]).to(device)
            y = torch.from_numpy(y_test[start : start + batch]).to(device)
            captured.clear()
            with autocast(device, amp):
                logits = model(x)
            mask = y != IGNORE
            probs = logits.float().softmax(-1)
            var.append(captured[0][mask].cpu())
            wrong.append((probs.argmax(-1) != y)[mask].cpu())
            unsure.append((1.0 - probs.max(-1).values)[mask].cpu())
            pos.append(torch.arange(y.shape[1], device=device).expand_as(y)[mask].cpu())
    finally:
        handle.remove()
        model.train()
    var, wrong, unsure, pos = (torch.cat(t).double().numpy() for t in (var, wrong, unsure, pos))
    wrong = wrong.astype(bool)
    by_pos = [auroc(var[pos == p], wrong[pos == p]) for p in np.unique(pos)]
    by_pos = [a for a in by_pos if a is not None]
    return {
        "error_rate": float(wrong.mean()),
        "mean_var_wrong": float(var[wrong].mean()) if wrong.any() else None,
        "mean_var_correct": float(var[~wrong].mean()) if (~wrong).any() else None,
        "auroc_var": auroc(var, wrong),
        "auroc_var_by_position": float(np.mean(by_pos)) if by_pos else None,
        "auroc_confidence": auroc(unsure, wrong),
        "filters": filters[0],
    }


def filter_calibration(layer, x) -> dict:
    """The toolkit's diagnostics of ``layer``'s filters on their own observations of ``x``.

    ``x`` (B, L, D) is the layer's input (the first rows of it: at most
    ``FILTER_CHECK_ELEMENTS`` (token, filter) pairs). Every filter ``(m, s)`` predicts ``v[m]`` at
    each token (:func:`kalmanscan.nn.layer_filters`); :func:`kalmanscan.diagnostics.report` over
    all of them gives ``mean_nis`` (1 for an honest predictive variance; above 1: over-confident),
    ``pit_mean`` and ``pit_var`` (1/2 and 1/12 when calibrated), ``pit_ks`` (Kolmogorov-Smirnov
    distance of the PIT from uniform) and ``coverage`` (the fraction of ``v`` inside each central
    predictive interval of ``FILTER_CHECK_LEVELS``). The report's pass/fail verdict is left out:
    the ``S`` filters of one ``m`` observe the same ``v[m]``, so its bands count correlated
    innovations as independent.
    """
    B, L = x.shape[:2]
    rows = max(1, min(B, FILTER_CHECK_ELEMENTS // max(1, L * layer.d_inner * layer.d_state)))
    obs, post = layer_filters(layer, x[:rows])
    rep = report(post, obs, levels=FILTER_CHECK_LEVELS)
    return {"rows": rows, "mean_nis": rep.mean_nis, "pit_mean": rep.pit_mean, "pit_var": rep.pit_var,
            "pit_ks": rep.pit_ks, "coverage": {f"{lvl:g}": c for lvl, c in rep.coverage.items()}}
