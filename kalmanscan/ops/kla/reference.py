"""The ``"reference"`` of the KLA scan: the token-by-token Kalman filter in mean-and-variance form,
in float64.

The independent oracle of every KLA backend: it never uses Möbius products, scans or the mean
gate of :mod:`kalmanscan.model.mobius`, but the textbook covariance form, per token and filter
``(m, s)`` (``phi = lam_v k^2``; observation ``v = k x + e``, ``e ~ N(0, 1/lam_v)``):

    pred_var = decay^2 var + noise,        pred_mu = decay mu,    r = 1 / (1 + phi pred_var)
    var = pred_var r,                      mu = pred_mu + var lam_v k (v - k pred_mu)
                                              = r pred_mu + var lam_v k v
    y = sum_s q mu,   y_var = sum_s q^2 var

the precision recursion of :mod:`kalmanscan.ops.kla` with ``var = 1/lam``, ``mu = eta/lam``
(``lam_pred var = 1 - phi var = r`` turns ``eta``'s update into the innovation form above). The
mean is computed in the last form: the innovation form subtracts ``var phi`` from 1, which loses
the mean's digits where ``phi pred_var >> 1`` (``y`` 5e-5 off in float64 at ``lam0 = 1e-12``).
Nothing grows: without process noise and with ``decay < 1`` the exact precision grows like
``decay^(-2t)`` and leaves float64's range, while ``var`` and ``mu`` only underflow towards their
exact limit 0, so outputs and gradients (by autograd, ``O(L)`` graph: small test shapes) stay
exact at every length. The variance's update is differentiated by
:func:`kalmanscan.ops.kla.recurrent.posterior_var` (autograd of the quotient cancels where
``phi pred_var >> 1``: the initial precision's gradient at ``lam0 = 1e-12`` was 7e-5 off in
float64). ``tests/kla_oracle.py`` checks it against 50-digit arithmetic.

:func:`kla_scan` has the signature every backend shares; :func:`kla_scan_moments` takes and returns
the variance and mean; :func:`kla_scan_sequential` the precision and information mean.
"""

from __future__ import annotations

import torch

from kalmanscan.ops.kla.documents import each_document
from kalmanscan.ops.kla.recurrent import posterior_var
from kalmanscan.ops.kla.state import FilterState, information

__all__ = ["kla_scan", "kla_scan_moments", "kla_scan_sequential"]


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor, initial_state: FilterState | None = None,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, FilterState]:
    """``(y, y_var, state)`` in float64, the signature of every KLA backend (``initial_state`` a
    pair ``(lam, eta)``, a :class:`FilterState` or ``None``; with ``cu_seqlens`` one row per
    document, :mod:`kalmanscan.ops.kla.documents`)."""
    v, lam_v, k, q, decay, noise = (x.double() for x in (v, lam_v, k, q, decay, noise))
    rows = v.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        var0 = torch.ones(rows, v.shape[2], k.shape[2], dtype=torch.float64, device=v.device)
        initial_state = FilterState.from_moments(var0, torch.zeros_like(var0))
    elif not isinstance(initial_state, FilterState):
        initial_state = FilterState.from_information(*(x.double() for x in initial_state))
    initial_state = initial_state.to(torch.float64)

    def scan(v, lam_v, k, q, decay, noise, state):
        y, y_var, var, mu = kla_scan_moments(v, lam_v, k, q, decay, noise, state.var, state.mu)
        return y, y_var, FilterState.from_moments(var, mu)

    if cu_seqlens is None:
        return scan(v, lam_v, k, q, decay, noise, initial_state)
    return each_document(scan, v, lam_v, k, q, decay, noise, initial_state, cu_seqlens)


def kla_scan_moments(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                     noise: torch.Tensor, var0: torch.Tensor | None = None, mu0: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filter of the module docstring from the variance ``var0 >= 0`` and mean ``mu0``
    ``(B, M, S)`` (default 1 and 0); returns ``(y, y_var, var, mu)`` as float64 tensors.
    Differentiable by autograd."""
    v, lam_v, k, q, decay, noise = (x.double() for x in (v, lam_v, k, q, decay, noise))
    B, L, M = v.shape
    S = k.shape[-1]
    var = torch.ones(B, M, S, dtype=torch.float64, device=v.device) if var0 is None else var0.double()
    mu = torch.zeros(B, M, S, dtype=torch.float64, device=v.device) if mu0 is None else mu0.double()
    ys, y_vars = [], []
    for t in range(L):
        kt = k[:, t, None, :]
        lv = lam_v[:, t, :, None]
        phi = lv * kt * kt
        pred_var = decay * decay * var + noise
        r = 1.0 / (1.0 + phi * pred_var)
        var = posterior_var(pred_var, phi)
        mu = r * (decay * mu) + var * lv * kt * v[:, t, :, None]
        qt = q[:, t, None, :]
        ys.append((qt * mu).sum(-1))
        y_vars.append((qt * qt * var).sum(-1))
    if L == 0:
        empty = v.new_zeros(B, 0, M)
        return empty, empty, var, mu
    return torch.stack(ys, 1), torch.stack(y_vars, 1), var, mu


def kla_scan_sequential(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                        noise: torch.Tensor, lam0: torch.Tensor | None = None, eta0: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kla_scan_moments` from and to the precision and information mean: ``(y, y_var, lam,
    eta)`` as float64 tensors (``lam = 1/var``, ``eta = mu/var``: ``inf`` where the exact precision
    is beyond float64's range, :func:`kalmanscan.ops.kla.information`)."""
    var0 = mu0 = None
    if lam0 is not None:
        var0 = 1.0 / lam0.double()
        mu0 = eta0.double() * var0
    y, y_var, var, mu = kla_scan_moments(v, lam_v, k, q, decay, noise, var0, mu0)
    return (y, y_var, *information(var, mu))
