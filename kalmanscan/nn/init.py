"""Initialisation schemes of the KLA layer and of the sequence model.

    ks.nn.KLA(d_model)                          # init="authors": the authors' current scheme (the default)
    ks.nn.KLA(d_model, init="kalmanscan")       # the toolkit's earlier scheme
    ks.nn.SequenceModel(...)                    # weight_init="normal" (the default): their whole recipe
    ks.nn.SequenceModel(..., init="kalmanscan", weight_init="torch")   # the earlier defaults

The default was chosen on MQAR (T = 512, 64 pairs, vocabulary 256, d_model 128, 2 layers, batch
128, rate 1e-3, four seeds per scheme, docs/results.md): the authors' recipe solved all four seeds
in 2,600-4,700 steps; the earlier one solved one of four (at 9,900 steps), the others at 77-89%
after 6,000-11,000 steps.

A scheme fixes what the layer starts from; the keywords of :class:`kalmanscan.nn.KLA` that a
scheme sets (``variant``, ``theta_init``, ``sigma_init``) still override it when given.

``"kalmanscan"``: the "plain" block; OU rates ``theta[m, s] = s + 1`` (S4D-real: memories from
about 1 to 1000 tokens in every channel); ``sigma = exp(log_sigma)`` starting at 0.1; the
observation variance from a projection with PyTorch's default initialisation (about
``softplus(0) = 0.69`` at the start); a per-channel skip ``D_skip`` (M,) at -1; the conv's
default bias.

``"authors"``: the scheme of the authors' code (vaisakh-shaj/kalman-linear-attention, commit
89df912), element by element:

* one rate, ``a = -1``: ``theta = 1`` for every filter (``src/kla/layers/kla_layer.py``,
  ``reset_parameters``: ``lambda_log.zero_()``, ``a = -exp(lambda_log)``);
* the process noise learned as ``exp(p_log)``, ``p = sigma^2``, from ``p = 3 |a| dt`` per filter
  (``configs.py``: ``process_noise_param="log"``, ``process_noise_init="heuristic"``;
  ``kla_layer.py``: ``p0 = 3 * exp(lambda_log) * delta``). The layer stores it as
  ``log_sigma_sq = log sigma^2``, their ``p_log``, so an optimiser moves it as it moves theirs;
* the observation variance at exactly ``1/d_state`` at the start: the projection that produces
  its log is zeroed (``var_expand`` for the "mamba" block, the log-variance rows of
  ``sensor_proj`` for "plain") and a learned per-channel bias ``obs_var_bias`` (M,) starts at
  ``softplus^-1(1/S - 1e-4)`` (``configs.py``: ``obs_noise_init="auto"``; ``kla_layer.py``:
  ``obs_noise_bias``, ``_reset_obs_noise_head``). The zeroed weight is marked so that the model's
  ``weight_init="normal"`` keeps it; as in their code the mark covers the whole ``sensor_proj``
  weight in the "plain" block, whose ``v``, ``k``, ``q`` rows then keep PyTorch's default;
* a learned scalar skip starting at -1 (``configs.py``: ``lambda_skip_mode="scalar"``,
  ``lambda_skip_init=-1.0``);
* the conv's bias at zero (``src/kla/layers/common.py``, ``CausalConv1d.reset_parameters``);
* the "mamba" block by default (``configs.py``: ``value_rank="conv"``, ``var_rank="auto"``:
  ``v = z`` and the log-variance through rank ``ceil(d_model / 8)``);
* every Linear and the embedding re-initialised ``N(0, 0.02)`` by their sequence model
  (``src/kla/models/sequence_model.py``, ``_init_weights``): here the model-level option
  ``SequenceModel(weight_init="normal")`` (:func:`normal_init_`), which applies to every mixer.

The same as ours in both: ``dt`` log-uniform in ``[1e-3, 1e-1]`` (theirs through a softplus, the
same initial values), the observation-variance floor ``1e-4``, L2-normalised ``k`` and ``q``.

:func:`initial_statistics` measures what a scheme's filters do at the start (docs/api.md).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["InitScheme", "SCHEMES", "DEFAULT_INIT", "init_scheme", "WEIGHT_INITS", "WEIGHT_INIT_DEFAULT",
           "initial_log_sigma", "obs_var_bias",
           "normal_init_", "initial_statistics"]


@dataclasses.dataclass(frozen=True)
class InitScheme:
    """What a scheme starts the layer from.

    ``variant``: the block when the caller does not choose one. ``theta_init``: ``"s4d"`` or one
    rate. ``sigma_init``: the initial ``sigma``, or ``None`` for ``sigma^2 = 3 theta dt``.
    ``log_noise_var``: store the noise as ``log_sigma_sq`` (else ``log_sigma``).
    ``obs_var_bias``: zeroed log-variance projection plus a per-channel bias at ``1/d_state``.
    ``scalar_skip``: one skip weight (else one per channel). ``zero_conv_bias``: the conv's bias at 0.
    """

    variant: str
    theta_init: str | float
    sigma_init: float | None
    log_noise_var: bool
    obs_var_bias: bool
    scalar_skip: bool
    zero_conv_bias: bool


SCHEMES = {
    "kalmanscan": InitScheme(variant="plain", theta_init="s4d", sigma_init=0.1, log_noise_var=False,
                             obs_var_bias=False, scalar_skip=False, zero_conv_bias=False),
    "authors": InitScheme(variant="mamba", theta_init=1.0, sigma_init=None, log_noise_var=True,
                          obs_var_bias=True, scalar_skip=True, zero_conv_bias=True),
}

WEIGHT_INITS = ("torch", "normal")

DEFAULT_INIT = "authors"          # chosen by MQAR T = 512, four seeds per scheme (docs/results.md)
WEIGHT_INIT_DEFAULT = "normal"


def init_scheme(init: str) -> InitScheme:
    """The :class:`InitScheme` named ``init`` (``ValueError`` naming ``init`` otherwise)."""
    if init not in SCHEMES:
        raise ValueError(f"init must be one of {tuple(SCHEMES)}, got {init!r}")
    return SCHEMES[init]


def initial_log_sigma(theta: torch.Tensor, dt: torch.Tensor, sigma_init: float | None) -> torch.Tensor:
    """``log sigma`` (M, S): ``log(sigma_init)`` everywhere, or with ``sigma_init=None`` the
    authors' ``sigma^2 = 3 theta dt`` per filter (its stationary variance ``sigma^2 / (2 theta)``
    is then ``1.5 dt``)."""
    if sigma_init is None:
        return 0.5 * torch.log(3.0 * theta * dt)
    return torch.full_like(theta, math.log(sigma_init))


def obs_var_bias(d_state: int, floor: float) -> float:
    """The bias ``b`` with ``softplus(b) + floor = 1 / d_state``."""
    target = 1.0 / d_state - floor
    if not target > 0:
        raise ValueError(f"d_state must be below 1/floor = {1 / floor:g} for init='authors', got {d_state}")
    return target + math.log(-math.expm1(-target))


def normal_init_(model: nn.Module, std: float = 0.02) -> None:
    """Every ``nn.Linear`` and ``nn.Embedding`` weight in ``model`` drawn from ``N(0, std^2)``, in
    place, except weights marked ``_no_reinit`` (the authors' zeroed observation-variance head).

    Biases, convolutions, norms and the mixers' own parameters (rates, steps, gate biases) are
    left as the modules made them: the authors' layer has no biases, and the baselines' biases
    carry their gate and step initialisations.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not getattr(module.weight, "_no_reinit", False):
                module.weight.normal_(0.0, std)


@torch.no_grad()
def initial_statistics(layer: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Three statistics of what a :class:`kalmanscan.nn.KLA` layer's filters do over ``x``.

    ``x`` (B, T, D) is the layer's input: at initialisation, e.g. random tokens through a fresh
    :class:`kalmanscan.nn.SequenceModel`'s embedding and the block's RMSNorm. The filters run the
    float64 token-by-token recursion of docs/math.md from ``lam = 1``: ``phi_t = lam_v k^2``,
    ``lam_pred_t = lam_{t-1} / (decay^2 + noise lam_{t-1})``, ``lam_t = lam_pred_t + phi_t``. The
    mean then moves as ``mu_t = g_t mu_{t-1} + (phi_t / lam_t) v_t / k``, with the forget gate of
    the mean ``g_t = decay lam_pred_t / lam_t = decay (1 - phi_t / lam_t)``. Every statistic is a
    median over the filters ``(m, s)`` and the batch, on the second half of the tokens (past the
    transient from the initial precision):

    * ``"current_share"``: ``phi_t / lam_t``, the share of the precision that comes from the
      current token (median also over those tokens);
    * ``"gate_dependence"``: ``std_t(log g_t) / |mean_t log g_t|`` per filter: 0 for a gate the
      input does not move, order 1 when the tokens decide how much is forgotten;
    * ``"memory"``: ``1 / |log g_t|`` tokens, the e-folding length of the mean's memory at that
      gate (median also over the tokens).

    Returns the three values as floats. Runs without gradients; memory ``O(B T M S)``.
    """
    _, _, _, (_, lam_v, k, _) = layer.observe(x)
    decay, noise = (t.double() for t in layer.discretized())
    lam_v, k = lam_v.double(), k.double()
    B, T, M = lam_v.shape
    lam = torch.ones(B, M, k.shape[-1], dtype=torch.float64, device=x.device)
    shares, log_gates = [], []
    for t in range(T):
        phi = lam_v[:, t, :, None] * k[:, t, None, :] ** 2
        lam = lam / (decay * decay + noise * lam) + phi
        if t >= T // 2:
            shares.append(phi / lam)
            log_gates.append(torch.log(decay) + torch.log1p(-phi / lam))
    share, log_g = torch.stack(shares), torch.stack(log_gates)
    return {"current_share": float(share.median()),
            "gate_dependence": float((log_g.std(0) / log_g.mean(0).abs()).median()),
            "memory": float((1.0 / log_g.abs()).median())}
