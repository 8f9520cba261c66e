"""A high-precision oracle of the KLA scan: the precision recursion in 120-digit arithmetic (mpmath),
and gradients by central differences in it. For tiny shapes only (pure Python, a few thousand
filter-steps a second).

mpmath's numbers have no exponent range to leave, so the oracle runs the plain information form
of docs/math.md (``lam``, ``eta``; the form the fast backends cannot carry without process noise)
and reads ``var = 1/lam``, ``mu = eta/lam`` at the end: a formulation independent of the mean-and-
variance reference (:mod:`kalmanscan.ops.kla.reference`) it checks. Central differences take a
step of 1e-40 relative to the input (1e-80 for an input of 0, such as ``noise = 0``, where the
loss stays analytic only within ``decay^2 / lam``, down to 1e-62 at ``decay = 0.1`` after 30
tokens): truncation errors near ``(step / radius)^2`` and rounding errors near 1e-40 relative to
the derivative's scale, exact for any float64 comparison.
"""

from __future__ import annotations

import mpmath
import torch

DIGITS = 120
STEP, ZERO_STEP = mpmath.mpf("1e-40"), mpmath.mpf("1e-80")
NAMES = ("v", "lam_v", "k", "q", "decay", "noise", "lam0", "eta0")


def _mp(x: torch.Tensor) -> list:
    """A float64 tensor as nested lists of mpf (exact conversions)."""
    return [_mp(r) for r in x] if x.ndim else mpmath.mpf(float(x))


def _filter(v, lam_v, k, q, decay, noise, lam0, eta0):
    """Nested lists in, ``(y, y_var, var, mu)`` as nested lists of mpf out."""
    B, L, M, S = len(v), len(v[0]), len(v[0][0]), len(k[0][0])
    y = [[[mpmath.mpf(0)] * M for _ in range(L)] for _ in range(B)]
    y_var = [[[mpmath.mpf(0)] * M for _ in range(L)] for _ in range(B)]
    var = [[[None] * S for _ in range(M)] for _ in range(B)]
    mu = [[[None] * S for _ in range(M)] for _ in range(B)]
    for b in range(B):
        for m in range(M):
            for s in range(S):
                a, n = decay[m][s], noise[m][s]
                lam, eta = lam0[b][m][s], eta0[b][m][s]
                for t in range(L):
                    kt, lv = k[b][t][s], lam_v[b][t][m]
                    rho = 1 / (a * a + n * lam)
                    lam = rho * lam + lv * kt * kt
                    eta = rho * a * eta + lv * v[b][t][m] * kt
                    y[b][t][m] += q[b][t][s] * eta / lam
                    y_var[b][t][m] += q[b][t][s] ** 2 / lam
                var[b][m][s], mu[b][m][s] = 1 / lam, eta / lam
    return y, y_var, var, mu


def _flat(x) -> list:
    return [z for r in x for z in _flat(r)] if isinstance(x, list) else [x]


def _unflat(values: list, shape: tuple) -> list:
    if not shape:
        return values[0]
    n = len(values) // shape[0]
    return [_unflat(values[i * n:(i + 1) * n], shape[1:]) for i in range(shape[0])]


def scan(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``(y, y_var, var, mu)`` as float64 tensors (each rounded once from 120 digits) from the eight
    float64 inputs ``(v, lam_v, k, q, decay, noise, lam0, eta0)``."""
    with mpmath.workdps(DIGITS):
        outs = _filter(*(_mp(x.double()) for x in xs))
        shapes = (xs[0].shape, xs[0].shape, xs[6].shape, xs[6].shape)
        return [torch.tensor([float(z) for z in _flat(o)], dtype=torch.float64).reshape(shape)
                for o, shape in zip(outs, shapes)]


def gradients(xs: list[torch.Tensor], weights: list[torch.Tensor],
              wrt: tuple[str, ...] = NAMES) -> dict[str, torch.Tensor]:
    """The gradients of ``sum_i <weights[i], outputs[i]>`` (outputs as :func:`scan`'s) with respect
    to the inputs named in ``wrt``, by central differences at 120 digits."""
    with mpmath.workdps(DIGITS):
        args = [_mp(x.double()) for x in xs]
        ws = [_flat(_mp(w.double())) for w in weights]

        def loss(a):
            return mpmath.fsum(w * o for wo, out in zip(ws, _filter(*a)) for w, o in zip(wo, _flat(out)))

        grads = {}
        for name in wrt:
            i = NAMES.index(name)
            flat = _flat(args[i])
            out = []
            for j, x in enumerate(flat):
                h = STEP * abs(x) if x else ZERO_STEP
                values = []
                for sign in (1, -1):
                    moved = list(flat)
                    moved[j] = x + sign * h
                    a = list(args)
                    a[i] = _unflat(moved, tuple(xs[i].shape))
                    values.append(loss(a))
                out.append(float((values[0] - values[1]) / (2 * h)))
            grads[name] = torch.tensor(out, dtype=torch.float64).reshape(xs[i].shape)
        return grads
