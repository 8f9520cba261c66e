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

The information mean follows ``eta_t = f_t eta_{t-1} + b_t`` with the forget gate
``f_t = a_t / (a_t^2 + q_t lam_{t-1})`` and ``b_t = h r (y_t - h mean)``; affine maps ``(f, b)``
compose as "s then t" ``-> (f_t f_s, f_t b_s + b_t)``. Here ``f`` is in ``[0, 1/a]`` and products of
forget gates only shrink towards 0, so the affine scan is as well conditioned as an ordinary
first-order linear recurrence.
"""

from __future__ import annotations

import torch

__all__ = ["leaf", "compose", "readout", "forget_gate", "affine_compose"]


def leaf(decay, noise, phi):
    """Möbius entries ``(A, B, C, D)`` of one predict-then-update step.

    ``decay`` (a), ``noise`` (q) and ``phi`` (h^2 r) broadcast together; all must be ``>= 0``.
    """
    a2 = decay * decay
    return 1.0 + noise * phi, a2 * phi, noise + 0.0 * phi, a2 + 0.0 * phi


def compose(earlier, later):
    """The product ``later @ earlier`` of two Möbius maps, rescaled by a power of two.

    Arguments and result are tuples ``(A, B, C, D)`` of broadcastable tensors with entries
    ``>= 0`` and positive trace. The result is divided by ``2^e`` where ``2^e <= trace < 2^(e+1)``
    (exact in floating point; ``e`` from the detached trace), so its trace lies in ``[1, 2)``.
    """
    A, B, C, D = product(earlier, later)
    return rescale((A, B, C, D), A + D)


def product(earlier, later):
    """The unscaled 2x2 product ``later @ earlier`` of ``(A, B, C, D)`` tuples."""
    eA, eB, eC, eD = earlier
    lA, lB, lC, lD = later
    return lA * eA + lB * eC, lA * eB + lB * eD, lC * eA + lD * eC, lC * eB + lD * eD


def rescale(entries, trace):
    """``entries`` divided by ``2^e``, ``2^e <= trace < 2^(e+1)`` (exact; ``e`` from the detached
    ``trace > 0``), so a map whose trace is ``trace`` gets a trace in ``[1, 2)``."""
    _, e = torch.frexp(trace.detach())
    # A floating-point exponent: ldexp's backward computes 2**shift, which is 0 in integer math.
    shift = (1 - e).to(trace.dtype)
    return tuple(torch.ldexp(x, shift) for x in entries)


def readout(P, lam0):
    """``lam = (A lam0 + B) / (C lam0 + D)``: the precision after the map ``P`` from ``lam0 >= 0``."""
    A, B, C, D = P
    return (A * lam0 + B) / (C * lam0 + D)


def forget_gate(decay, noise, lam_prev):
    """``f = a / (a^2 + q lam_prev)``: how much of the previous information mean survives."""
    return decay / (decay * decay + noise * lam_prev)


def affine_compose(earlier, later):
    """``(f, b)`` maps ``eta -> f eta + b`` composed as "earlier then later"."""
    f1, b1 = earlier
    f2, b2 = later
    return f2 * f1, f2 * b1 + b2
