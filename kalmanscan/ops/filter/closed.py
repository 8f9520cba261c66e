"""The triton backend's forward for static parameters and a regular ``dt``: the precision in closed
form, the information mean as a first-order linear recurrence (:mod:`kalmanscan.kernels.filter.closed`,
docs/math.md §9).

:func:`kalmanscan.ops.filter.triton.filter_forward` hands a problem here when no parameter varies
along time (so ``times`` is not given: they make ``dt`` per step) and ``FilterConfig.closed`` is on;
it writes the same fields with the same conventions as the walks, so the posterior, the centred
outputs of the autograd path and the backward walks (which read the filtered mean and precision
back) are unchanged. :func:`constants` computes each channel's fixed point and closed-form
coefficients in float64; :func:`plan` picks the tile and the time split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kalmanscan.kernels.filter.closed import closed_agg_kernel, closed_fwd_kernel
from kalmanscan.kernels.filter.fwd import filter_carry_kernel

from ..launch import cdiv, next_power_of_2
from .config import DEFAULT_CONFIG, FilterConfig

__all__ = ["constants", "plan", "forward", "STEADY_TOL"]

# The carried precision counts as the fixed point within a few ulps of it (float32: 2^-21).
STEADY_TOL = {torch.float32: 2.0**-21, torch.float64: 2.0**-48}
# -log rho is capped here: rho^k underflows to 0 for every k >= 1 in float64 either way, and
# k * cap stays finite at k = 0.
_MAX_NLR = 2000.0


def constants(theta: torch.Tensor, sigma: torch.Tensor, dt: torch.Tensor, obs_var: torch.Tensor,
              mean: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, 13, C)`` per-channel constants of the kernels, from ``(B, C)`` static parameters.

    Computed in float64, returned in ``dtype``. With ``a = exp(-theta dt)``, noise ``q`` and
    ``phi = h^2 / obs_var``: the fixed point ``lam* = (b + sqrt(b^2 + 4 a^2 q phi)) / (2 q)``,
    ``b = 1 - a^2 + q phi >= 0`` (no cancellation: both terms are non-negative), the predicted
    precision there ``lam*_p = lam* / k``, ``k = a^2 + q lam*`` (the map's larger eigenvalue),
    the steady forget gate ``f* = a / k`` with ``1 - f* = (1 - a) + a phi / lam*`` (non-negative
    terms, ``1 - a`` by ``expm1``), ``rho = f*^2`` (the ratio of the eigenvalues) with
    ``-log rho = -2 log1p(-(1 - f*))``, and the deviation coefficients ``c = q / (k (1 - rho))``
    (precision form) and ``phi a^2 / (k (1 - rho))`` (variance form). ``usable`` is 1 where every
    constant is finite and positive in ``dtype`` and ``rho < 1``; elsewhere (e.g. ``theta = 0``
    with ``sigma = 0`` or ``h = 0``, where the map has no attracting fixed point) the kernels scan
    the Möbius matrices instead.
    """
    theta, sigma, dt, obs_var, mean, h = (x.detach().to(torch.float64) for x in (theta, sigma, dt, obs_var, mean, h))
    x = theta * dt
    a = torch.exp(-x)
    one_minus_a = -torch.expm1(-x)
    one_minus_a2 = -torch.expm1(-2.0 * x)
    ratio = torch.where(x > 0, one_minus_a2 / torch.where(x > 0, 2.0 * theta, 1.0), dt)
    q = sigma * sigma * ratio
    phi = h * h / obs_var
    b = one_minus_a2 + q * phi
    lam_star = (b + torch.sqrt(b * b + 4.0 * a * a * q * phi)) / (2.0 * q)
    k = a * a + q * lam_star
    lam_pred = lam_star / k
    gain = phi / lam_star
    f_star = a * lam_pred / lam_star
    one_minus_f = one_minus_a + a * gain
    one_minus_rho = one_minus_f * (1.0 + f_star)
    nlr = torch.clamp(-2.0 * torch.log1p(-one_minus_f), max=_MAX_NLR)
    c_lam = q / (k * one_minus_rho)
    c_var = phi * a * a / (k * one_minus_rho)
    rows = [a, q, obs_var, mean, h, lam_star, 1.0 / lam_star, f_star, 1.0 / lam_pred, nlr, c_lam, c_var]
    out = torch.stack([r.expand_as(lam_star) for r in rows], 1).to(dtype)
    positive = (out[:, 5:7] > 0).all(1) & (out[:, 8:10] > 0).all(1)   # lam*, var*, 1/lam_pred*, nlr
    usable = torch.isfinite(out[:, 5:12]).all(1) & positive & (one_minus_rho > 0)
    return torch.cat([out, usable.to(dtype).unsqueeze(1)], 1).contiguous()


def plan(B: int, T: int, C: int, config: FilterConfig = DEFAULT_CONFIG) -> tuple[int, int, int, int]:
    """``(NS, R, CHUNK, BLOCK_C)``: ``NS`` stretches of ``R`` chunks of ``CHUNK`` steps, tiles of
    ``BLOCK_C`` channels. ``BLOCK_C`` is ``config.closed_block`` or the next power of two of ``C``
    if smaller; ``CHUNK = config.closed_tile / BLOCK_C`` (at most the next power of two of ``T``);
    time is split only when fewer than ``config.closed_programs`` programs cover the channels."""
    block = min(config.closed_block, next_power_of_2(C))
    chunk = max(1, min(next_power_of_2(config.closed_tile // block + 1) // 2, next_power_of_2(T)))
    chunks = cdiv(T, chunk)
    programs = B * cdiv(C, block)
    ns = max(1, min(cdiv(config.closed_programs, programs), chunks))
    r = cdiv(chunks, ns)
    return cdiv(chunks, r), r, chunk, block


def forward(views: Mapping[str, torch.Tensor], init: torch.Tensor, pointers: Sequence[torch.Tensor],
            write: Mapping[str, bool], mask: int, config: FilterConfig = DEFAULT_CONFIG) -> None:
    """Launch the closed-form forward on ``(B, T, C)`` views with static parameters.

    ``views`` maps ``y, theta, sigma, dt, obs_var, mean, h`` to ``(B, T, C)`` tensors (the
    parameters with time stride 0); ``init`` is ``(B, 2, C)``: initial precision and information
    mean. ``pointers`` are the ten output tensors in the kernels' order (a one-element dummy for
    those not written), ``write`` the ``WRITE_MU, WRITE_LAM, WRITE_PRED`` flags and ``mask`` the
    ``POSTERIOR`` bit mask (:func:`kalmanscan.kernels.filter.steps.emit_step`). Writes into
    ``pointers``; returns nothing.
    """
    y = views["y"]
    B, T, C = y.shape
    dtype, dev = y.dtype, y.device
    static = [views[k][:, 0, :] for k in ("theta", "sigma", "dt", "obs_var", "mean", "h")]
    consts = constants(*static, dtype=dtype)
    ns, r, chunk, block = plan(B, T, C, config)
    grid = (cdiv(C, block), ns, B)
    opts = dict(CHUNK=chunk, BLOCK_C=block, WIDE=4 * B * T * C >= config.wide_from, num_warps=config.closed_warps)
    start = torch.empty(B, 2, ns, C, dtype=dtype, device=dev)
    start[:, :, 0, :] = init
    if ns > 1:
        agg = torch.empty(B, 7, ns, C, dtype=dtype, device=dev)
        closed_agg_kernel[grid](y, *y.stride(), consts, agg, T, C, ns, r, **opts)
        filter_carry_kernel[(B * C,)](agg, start, C, ns, CH=min(config.carry_chunk, next_power_of_2(ns - 1)),
                                      num_warps=config.carry_warps)
    closed_fwd_kernel[grid](y, *y.stride(), consts, start, *pointers, T, C, ns, r, STEADY_TOL[dtype],
                            **write, POSTERIOR=mask, **opts)

