"""The Möbius (precision) and affine (information mean) algebra of the diagonal Kalman filter.

One step of the information-form filter with decay ``a``, process noise ``q`` and observation
precision ``phi = h^2 r`` (``r = 1/obs_var``; ``phi = 0`` for a missing observation) maps the
previous precision ``lam`` to

    lam' = ((1 + q phi) lam + a^2 phi) / (q lam + a^2)

the Möbius map of the matrix ``M = [[1 + q phi, a^2 phi], [q, a^2]]``. A map is stored as its four
entries ``(A, B, C, D)``; "s then t" is ``M_t @ M_s`` (later steps multiply on the left), and a
prefix product ``P`` is read projectively: ``lam_t = (A lam_0 + B) / (C lam_0 + D)``.

Numerics. Every leaf entry is ``>= 0`` and the diagonal is ``>= a^2 + 1 > 0``, so every product of
leaves has non-negative entries and a positive trace: a product entry is a sum of products of
non-negative numbers, so nothing cancels and each entry carries only the relative rounding of its
own multiply-adds (at most ``2 depth`` ulps for a scan tree of depth ``depth``). Products grow like
the product of their leaves' traces, so :func:`compose` divides each product by the power of two
nearest below its trace (an exact scaling in floating point, which the projective read-out ignores)
to keep the entries in ``[2^-k, 2]``-ish range without overflow. The scale factor is taken from the
detached trace: it is piecewise constant, so autograd through the rescaled product is exact.
The read-out ``(A lam_0 + B) / (C lam_0 + D)`` is again a ratio of positive sums for ``lam_0 >= 0``.

The backends read the scan out as the variance ``var_t = 1 / lam_t = (C lam_0 + D) / (A lam_0 + B)``
(:func:`readout_var`), not the precision: with no process noise (``q = 0``) and ``a < 1`` the exact
precision grows like ``a^(-2t)`` and leaves the floating-point range, while the variance only
underflows towards its exact value 0. For the same reason the mean is scanned in mean form, not
as the information mean ``eta = lam mu`` (whose forget gate ``a / (a^2 + q lam)`` is ``1/a > 1``
when ``q = 0``): ``mu_t = g_t mu_{t-1} + b_t var_t`` with the gate
``g_t = a_t / (1 + phi_t pred_var_t)``, ``pred_var_t = a_t^2 var_{t-1} + q_t`` (:func:`mean_gate`)
and ``b_t = h r (y_t - h mean)``. Here ``g`` is in ``[0, a]`` and ``b_t var_t`` is bounded, so the
affine scan, with maps ``(g, w)`` composed as "s then t" ``-> (g_t g_s, g_t w_s + w_t)``, is as
well conditioned as an ordinary first-order linear recurrence for every ``q >= 0``.
"""

from __future__ import annotations

import torch

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A Möbius map's ``(A, B, C, D)``, tensors broadcastable to one shape."""


__all__ = ["leaf", "compose", "product", "rescale", "readout", "readout_var", "propagate_var", "mean_gate",
           "decaying_noise", "precision_overflows", "noise_bound", "lacks_noise", "no_process_noise", "NO_NOISE",
           "affine_compose"]


def leaf(decay: torch.Tensor, noise: torch.Tensor, phi: torch.Tensor) -> Entries:
    """Möbius entries ``(A, B, C, D)`` of one predict-then-update step.

    ``decay`` (a), ``noise`` (q) and ``phi`` (h^2 r) broadcast together; all must be ``>= 0``.
    """
    a2 = decay * decay
    return 1.0 + noise * phi, a2 * phi, noise + 0.0 * phi, a2 + 0.0 * phi


def compose(earlier: Entries, later: Entries) -> Entries:
    """The product ``later @ earlier`` of two Möbius maps, rescaled by a power of two.

    Arguments and result are tuples ``(A, B, C, D)`` of broadcastable tensors with entries
    ``>= 0`` and positive trace. The result is divided by ``2^e`` where ``2^e <= trace < 2^(e+1)``
    (exact in floating point; ``e`` from the detached trace), so its trace lies in ``[1, 2)``.
    """
    A, B, C, D = product(earlier, later)
    return rescale((A, B, C, D), A + D)


def product(earlier: Entries, later: Entries) -> Entries:
    """The unscaled 2x2 product ``later @ earlier`` of ``(A, B, C, D)`` tuples."""
    eA, eB, eC, eD = earlier
    lA, lB, lC, lD = later
    return lA * eA + lB * eC, lA * eB + lB * eD, lC * eA + lD * eC, lC * eB + lD * eD


def rescale(entries: tuple[torch.Tensor, ...], trace: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``entries`` divided by ``2^e``, ``2^e <= trace < 2^(e+1)`` (exact; ``e`` from the detached
    ``trace > 0``), so a map whose trace is ``trace`` gets a trace in ``[1, 2)``."""
    _, e = torch.frexp(trace.detach())
    # A floating-point exponent: ldexp's backward computes 2**shift, which is 0 in integer math.
    shift = (1 - e).to(trace.dtype)
    return tuple(torch.ldexp(x, shift) for x in entries)


def readout(P: Entries, lam0: torch.Tensor | float) -> torch.Tensor:
    """``lam = (A lam0 + B) / (C lam0 + D)``: the precision after the map ``P`` from ``lam0 >= 0``."""
    A, B, C, D = P
    return (A * lam0 + B) / (C * lam0 + D)


NO_NOISE = {torch.float32: 1e-30, torch.float64: 1e-290}  # process noise treated as none


def precision_overflows(min_noise: torch.Tensor | float, dtype: torch.dtype) -> bool:
    """Whether the information-form recursion (which carries ``lam``) can leave the range of
    ``dtype``: ``min_noise`` is the smallest process noise among filters with ``decay < 1``.

    With noise ``q`` the precision stays below about ``1/q`` plus the observation precision; below
    :data:`NO_NOISE` that bound is out of range, and with ``q = 0`` the precision grows like
    ``decay^(-2t)`` without bound (its exact value overflows). Backends that carry the variance
    and the mean (the torch ones) are unaffected.
    """
    return float(min_noise) < noise_bound(dtype)


def noise_bound(dtype: torch.dtype) -> float:
    """:data:`NO_NOISE` for ``dtype`` (float32's for any other dtype)."""
    return NO_NOISE.get(dtype, NO_NOISE[torch.float32])


def decaying_noise(decay: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``noise`` where ``decay < 1``, else 1 (detached): its minimum is what
    :func:`precision_overflows` takes."""
    return torch.where(decay.detach() < 1, noise.detach(), 1.0)


def lacks_noise(decay: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """:func:`precision_overflows` for broadcastable ``decay`` and ``noise`` tensors, as a 0-d
    bool tensor on their device (no synchronisation)."""
    with torch.no_grad():
        return decaying_noise(decay, noise).amin() < noise_bound(noise.dtype)


def no_process_noise(decay: torch.Tensor, noise: torch.Tensor) -> bool:
    """:func:`lacks_noise` read back (one sync)."""
    return bool(lacks_noise(decay, noise))


def readout_var(P: Entries, lam0: torch.Tensor | float) -> torch.Tensor:
    """``var = (C lam0 + D) / (A lam0 + B)``: the variance ``1 / lam`` after the map ``P`` from
    ``lam0 > 0``, a ratio of non-negative sums that stays in range when ``lam`` would not."""
    A, B, C, D = P
    return (C * lam0 + D) / (A * lam0 + B)


def propagate_var(P: Entries, var0: torch.Tensor | float) -> torch.Tensor:
    """``var = (C + D var0) / (A + B var0)``: :func:`readout_var` from the variance ``var0 >= 0``
    instead of the precision, so ``var0 = 0`` (a precision beyond the floating-point range) gives
    ``C / A``, not ``inf / inf``."""
    A, B, C, D = P
    return (C + D * var0) / (A + B * var0)


def mean_gate(decay: torch.Tensor, pred_var: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``g = a / (1 + phi pred_var)`` in ``[0, a]``: the weight of the previous mean in the updated
    mean ``mu = g mu_prev + b var`` (``pred_var = a^2 var_prev + q`` the predicted variance)."""
    return decay / (1.0 + phi * pred_var)


def affine_compose(earlier: tuple[torch.Tensor, torch.Tensor],
                   later: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, w)`` maps ``x -> g x + w`` composed as "earlier then later"."""
    f1, b1 = earlier
    f2, b2 = later
    return f2 * f1, f2 * b1 + b2
