"""A long series cut into consecutive stretches along time, filtered and smoothed exactly.

What the sequence-parallel filter (:mod:`kalmanscan.distributed`, one stretch per rank) and the
time-chunked dask path (:mod:`kalmanscan.xr.timechunks`, one stretch per chunk) share:

- :func:`summary`: a stretch's steps as one product in the merged form (:mod:`kalmanscan.model.merged`,
  7 numbers per channel, independent of the belief entering it), with the transition into its
  first step (or, for the first stretch, the initial belief);
- :func:`belief`: a filtered belief ``N(mu, var)`` (centred) as the summary ``K`` that sets the
  state, in the moment form (``var = 0`` and ``mu`` stay exact);
- :func:`rts_link`: a stretch's RTS recursion as one affine map, from the smoothed moments at its
  last step back to those at the previous stretch's last step.
"""

from __future__ import annotations

import torch

from kalmanscan.model import merged
from kalmanscan.ops.filter import get_backend
from kalmanscan.ops.filter.torch import gain_terms
from kalmanscan.problem.problem import Problem

__all__ = ["summary", "belief", "rts_link"]


def summary(p: Problem, first: bool, backend: str = "torch") -> tuple[torch.Tensor, ...]:
    """The stretch ``p``'s 7-tuple, each ``(..., 1, C)``: the product of its steps by ``backend``
    (``"torch"``: differentiable; ``"triton"`` and ``"cpu"``: fused kernels or a compiled loop,
    forward only), composed after the initial belief when ``first``, else after the transition
    into its first step (``p``'s decay and noise at index 0)."""
    shape = p.shape
    local = get_backend(backend).summary(p)
    if not first:
        decay, noise = p.decay_noise()
        a0, q0 = (torch.broadcast_to(x[..., :1, :], shape[:-2] + (1, shape[-1])) for x in (decay, noise))
        zero = torch.zeros_like(a0)
        return merged.compose(merged.leaf(a0, q0, zero, zero), local)
    lam0 = (1.0 / p.init_var).expand(shape[:-2] + (1, shape[-1]))
    eta0 = lam0 * (p.init_mean - p.mean[..., :1, :])
    return merged.compose(merged.initial(lam0, eta0), local)


def belief(var: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The summary ``K`` that sets the state to the belief ``N(mu, var)`` (centred): ``(0, 1, 0,
    var, 0, mu, 0)``, :func:`kalmanscan.model.merged.initial` scaled by ``var`` (the form is
    homogeneous), so a variance of 0 reads back as 0. An infinite variance (nothing observed under
    a diffuse prior) gives ``initial(0, 0)``."""
    unknown = torch.isinf(var)
    zero, one = torch.zeros_like(var + mu), torch.ones_like(var + mu)
    B = torch.where(unknown, zero, one)
    D = torch.where(unknown, one, var + zero)
    F = torch.where(unknown, zero, mu + zero)
    return zero, B, zero, D, zero, F, zero


def rts_link(f: dict[str, torch.Tensor], mean_param: torch.Tensor, carry: tuple[torch.Tensor, torch.Tensor] | None,
             last: bool) -> torch.Tensor:
    """``[F_mean, B_mean, F_var, B_var]`` ``(4, ..., 1, C)``: the stretch's smoothed moments at
    the previous stretch's last step as an affine map of those at its own last step. ``f`` holds
    the stretch's filter tensors (``mean, var, pred_mean, pred_var, decay, noise``, each ``(...,
    T, C)``), ``carry = (var, mu)`` the filtered belief (centred) at the previous stretch's last
    step. For the ``last`` stretch the map is constant (its last step's smoothed moments are the
    filtered ones). Zeros for the first stretch (``carry is None``), which no stretch reads."""
    mu, J, bm, bv = _unknown_limit(*gain_terms(f, mean_param), f["var"][..., :-1, :], f["decay"][..., 1:, :],
                                   f["noise"][..., 1:, :])
    if carry is None:
        return torch.zeros((4,) + mu[..., -1:, :].shape, dtype=mu.dtype, device=mu.device)
    ones, zeros = torch.ones_like(mu[..., -1:, :]), torch.zeros_like(mu[..., -1:, :])
    end_mean = (zeros, mu[..., -1:, :]) if last else (ones, zeros)
    end_var = (zeros, f["var"][..., -1:, :]) if last else (ones, zeros)
    var_prev, mu_prev = carry
    a0, q0, pv0 = (f[k][..., :1, :] for k in ("decay", "noise", "pred_var"))
    J0 = a0 * var_prev / pv0
    bm0 = mu_prev - J0 * (f["pred_mean"][..., :1, :] - mean_param[..., :1, :])
    bv0 = var_prev * q0 / pv0
    _, J0, bm0, bv0 = _unknown_limit(mu_prev, J0, bm0, bv0, var_prev + zeros, a0, q0)
    Fm, Bm = merged.affine_total(torch.cat([J0, J, end_mean[0]], -2), torch.cat([bm0, bm, end_mean[1]], -2), -2)
    Fv, Bv = merged.affine_total(torch.cat([J0 * J0, J * J, end_var[0]], -2), torch.cat([bv0, bv, end_var[1]], -2), -2)
    return torch.stack([Fm, Bm, Fv, Bv])


def _unknown_limit(mu, J, bm, bv, var, a_next, q_next):
    """The RTS terms where the filtered variance ``var`` is still infinite (a diffuse prior, not
    yet observed) replaced by their limits as ``var -> inf``: ``J = 1/a``, ``bm = 0`` (the
    prediction of an unknown state is unknown alike) and ``bv = q / a^2``."""
    unknown = torch.isinf(var)
    return (mu, torch.where(unknown, 1.0 / a_next, J), torch.where(unknown, torch.zeros_like(bm), bm),
            torch.where(unknown, q_next / (a_next * a_next), bv))
