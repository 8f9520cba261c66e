"""The ``"reference"`` of the KLA scan: the plain token-by-token precision recursion in float64.

The independent oracle of every KLA backend (it never uses Möbius products, scans or the mean
form). :func:`kla_scan` has the signature every backend shares; :func:`kla_scan_sequential`
takes and returns the precision and information mean directly.
"""

from __future__ import annotations

import torch

from kalmanscan.ops.kla.state import FilterState

__all__ = ["kla_scan", "kla_scan_sequential"]


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor,
             initial_state: FilterState | None = None) -> tuple[torch.Tensor, torch.Tensor, FilterState]:
    """``(y, y_var, state)`` in float64, the signature of every KLA backend (``initial_state`` a
    pair ``(lam, eta)`` or ``None``)."""
    lam0, eta0 = (None, None) if initial_state is None else initial_state
    y, y_var, lam, eta = kla_scan_sequential(v, lam_v, k, q, decay, noise, lam0, eta0)
    return y, y_var, FilterState.from_information(lam, eta)


def kla_scan_sequential(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                        noise: torch.Tensor, lam0: torch.Tensor | None = None, eta0: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain token-by-token recursion in float64: the independent oracle for both backends.

    Same shapes as :func:`kla_scan`; returns ``(y, y_var, lam, eta)`` as float64 tensors.
    Differentiable by autograd (O(L) graph; meant for small test shapes).
    """
    v, lam_v, k, q, decay, noise = (x.double() for x in (v, lam_v, k, q, decay, noise))
    B, L, M = v.shape
    S = k.shape[-1]
    lam = torch.ones(B, M, S, dtype=torch.float64, device=v.device) if lam0 is None else lam0.double()
    eta = torch.zeros(B, M, S, dtype=torch.float64, device=v.device) if eta0 is None else eta0.double()
    ys, y_vars = [], []
    for t in range(L):
        kt = k[:, t, None, :]
        phi = lam_v[:, t, :, None] * kt * kt
        rho = 1.0 / (decay * decay + noise * lam)
        lam = rho * lam + phi
        eta = rho * decay * eta + (lam_v[:, t] * v[:, t])[:, :, None] * kt
        qt = q[:, t, None, :]
        ys.append((qt * eta / lam).sum(-1))
        y_vars.append((qt * qt / lam).sum(-1))
    if L == 0:
        empty = v.new_zeros(B, 0, M)
        return empty, empty, lam, eta
    return torch.stack(ys, 1), torch.stack(y_vars, 1), lam, eta
