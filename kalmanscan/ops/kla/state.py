"""The state of the KLA filters and the input preparation every KLA backend shares.

:class:`FilterState` is what :func:`kalmanscan.ops.kla.kla_scan` returns and continues from;
:func:`prepare` casts the inputs to the compute dtype (:func:`compute_dtype`) and builds the initial
state (``lam = 1, eta = 0`` unless given).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FilterState", "information", "compute_dtype", "prepare"]


def information(var: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lam, eta) = (1 / var, mu / var)`` from the variance ``var >= 0`` and the mean ``mu``.

    Where ``var`` underflowed to 0 the exact precision is beyond the range: ``lam = inf`` and
    ``eta = +-inf``, or 0 where ``mu`` underflowed to 0 as well (their ratio is lost; never NaN).
    """
    return 1.0 / var, torch.where(mu == 0, mu, mu / var)


class FilterState(tuple):
    """The ``(B, M, S)`` filters' state returned by :func:`kla_scan`: a pair that unpacks as the
    precision and information mean ``(lam, eta)``, and carries the variance and mean ``var``,
    ``mu`` that :func:`kla_scan` continues from when given it as ``initial_state``.

    ``var`` and ``mu`` stay exact in the floating-point range at every length (they only
    underflow towards 0); ``lam`` and ``eta`` are exact where in range and follow
    :func:`information` beyond it (``inf``, never NaN). A state made from ``(lam, eta)`` alone
    computes ``var = 1 / lam`` and ``mu = eta var`` when first read (a call that does not return
    its state launches nothing for them).
    """

    def __new__(cls, lam, eta, var=None, mu=None):
        state = super().__new__(cls, (lam, eta))
        state._var, state._mu = var, mu
        return state

    @property
    def var(self) -> torch.Tensor:
        if self._var is None:
            self._var = 1.0 / self[0]
        return self._var

    @property
    def mu(self) -> torch.Tensor:
        if self._mu is None:
            self._mu = self[1] * self.var
        return self._mu

    def __getnewargs__(self):
        return (*self, self.var, self.mu)

    @classmethod
    def from_moments(cls, var: torch.Tensor, mu: torch.Tensor) -> FilterState:
        """The state of variance ``var >= 0`` and mean ``mu``."""
        return cls(*information(var, mu), var, mu)

    @classmethod
    def from_information(cls, lam: torch.Tensor, eta: torch.Tensor) -> FilterState:
        """The state of precision ``lam > 0`` and information mean ``eta`` (``var``, ``mu`` computed
        when first read)."""
        return cls(lam, eta)

    def rows(self, start: int, stop: int) -> FilterState:
        """The state of rows ``start .. stop - 1`` (views)."""
        return FilterState(*(x[start:stop] for x in (*self, self.var, self.mu)))

    @classmethod
    def cat(cls, states: list[FilterState]) -> FilterState:
        """The states' rows, in order, as one state."""
        return cls(*(torch.cat(xs) for xs in zip(*((*s, s.var, s.mu) for s in states))))

    def to(self, dtype: torch.dtype) -> FilterState:
        """The four tensors cast to ``dtype``."""
        return FilterState(*(x.to(dtype) for x in (*self, self.var, self.mu)))


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any tensor is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def prepare(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
            noise: torch.Tensor,
            initial_state: FilterState, rows: int | None = None) -> tuple[Any, ...]:
    """The inputs in the compute dtype and the initial :class:`FilterState` (``lam = 1, eta = 0``
    for ``None``, with ``rows`` rows, default ``B``: one per document with ``cu_seqlens``; from a
    ``(lam, eta)`` pair; a given :class:`FilterState` cast)."""
    dtype = compute_dtype(v, lam_v, k, q, decay, noise)
    v, lam_v, k, q, decay, noise = (x.to(dtype) for x in (v, lam_v, k, q, decay, noise))
    if initial_state is None:
        B, _, M = v.shape
        ones = torch.ones(B if rows is None else rows, M, k.shape[-1], dtype=dtype, device=v.device)
        zeros = torch.zeros_like(ones)
        initial_state = FilterState(ones, zeros, ones, zeros)
    elif not isinstance(initial_state, FilterState):
        initial_state = FilterState.from_information(*(x.to(dtype) for x in initial_state))
    return v, lam_v, k, q, decay, noise, initial_state.to(dtype)
