"""The result of :func:`kalmanscan.fit`: estimates, standard errors and the fitted model's calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kalmanscan.inference.filtering import filter as _filter
from kalmanscan.types import ArrayLike

if TYPE_CHECKING:
    from kalmanscan.inference.posterior import Posterior

__all__ = ["FitResult"]


@dataclass
class FitResult:
    """Maximum-likelihood fit of :func:`kalmanscan.filter`'s model (returned by :func:`fit`).

    For ``y`` of shape ``(..., T, C)`` with ``B = y.shape[:-2]`` and ``Cp = C`` (per channel) or
    ``1`` (``shared=True``):

    - ``params``: ``theta, sigma, obs_var, mean`` (and ``init_mean, init_var`` when given or
      estimated). Estimated model parameters have shape ``(Cp,)`` (or ``B + (1, Cp)`` with batch
      dimensions), estimated ``init_*`` have ``B + (Cp,)``: the static shapes ``ks.filter`` takes.
      Fixed ones are as given. NumPy when ``y`` was NumPy, detached tensors when it was a tensor.
    - ``loglik``: the log-likelihood at the optimum per series, ``B + (C,)``.
    - ``converged``, ``n_iter``, ``message``: what the optimiser did; ``converged`` is False too
      when a series had fewer observations than estimated parameters (see ``reason``).
    - ``reason``: why ``converged`` is False (``""`` when it is True): the optimiser's message, or
      the series left unfitted (their parameters are the initial guess, their standard errors NaN).
    - ``names``: the estimated names, in the order of ``cov``'s axes.
    - ``stderr``: standard error per estimated name (same shape as its ``params`` entry), the square
      root of the diagonal of ``cov``; NaN for a parameter on its boundary, for a series left
      unfitted, and where the Hessian block of the free parameters is not positive definite.
    - ``on_boundary``: per estimated name, a boolean array (shape of its ``stderr``): True where the
      optimum is on the parameter's lower boundary 0.
    - ``fitted``: ``B + (Cp,)`` booleans, False for a series left unfitted (fewer observed values
      than estimated names).
    - ``cov``: ``B + (Cp, P, P)``, the inverse Hessian of ``-loglik`` in the natural parameters.
    - ``n_obs``: observed (non-NaN) values per series, ``B + (C,)``.
    """

    params: dict
    loglik: Any
    converged: bool
    n_iter: int
    message: str
    stderr: dict
    cov: Any
    names: tuple
    n_obs: Any
    method: str = "lbfgs"
    settings: dict = field(default_factory=dict, repr=False)
    reason: str = ""
    on_boundary: dict = field(default_factory=dict)
    fitted: Any = None

    @property
    def filter_kwargs(self) -> dict:
        """Every keyword :func:`kalmanscan.filter` needs to run the fitted model."""
        return {**self.params, **self.settings}

    def filter(self, y: ArrayLike, **overrides: Any) -> Posterior:
        """:func:`kalmanscan.filter` of ``y`` under the fitted model (keywords override)."""
        return _filter(y, **{**self.filter_kwargs, **overrides})

    def smooth(self, y: ArrayLike, **overrides: Any) -> Posterior:
        """:func:`kalmanscan.smooth` of ``y`` under the fitted model (keywords override)."""
        from kalmanscan.inference.smoothing import smooth

        return smooth(y, **{**self.filter_kwargs, **overrides})

    def __repr__(self) -> str:
        ll = as_numpy(self.loglik)
        n = as_numpy(self.n_obs)
        status = "converged" if self.converged else "NOT converged"
        lines = [f"FitResult ({METHOD_NAMES[self.method]}, {status} after {self.n_iter} iterations: {self.message})",
                 f"log-likelihood {ll.sum():.6g} over {int(n.sum())} observations in {n.size} series"]
        est = {k: as_numpy(self.params[k]) for k in self.names}
        se = {k: as_numpy(v) for k, v in self.stderr.items()}
        flat = {k: v.reshape(-1) for k, v in est.items()}
        flat_se = {k: v.reshape(-1) for k, v in se.items()}
        blocks = next(iter(flat.values())).size if flat else 0
        shape = _block_shape(est)
        labels = ["all" if blocks == 1 else ",".join(str(int(i)) for i in np.unravel_index(b, shape))
                  for b in range(min(blocks, _REPR_BLOCKS))]
        width = max([10, *(len(label) + 2 for label in labels)])
        lines.append(f"{'series':<{width}}{'param':<11}{'estimate':>14}{'std.err':>12}")
        for b, label in enumerate(labels):
            for i, k in enumerate(self.names):
                lines.append(f"{label if i == 0 else '':<{width}}{k:<11}{flat[k][b]:>14.6g}{flat_se[k][b]:>12.4g}")
        if blocks > _REPR_BLOCKS:
            lines.append(f"... and {blocks - _REPR_BLOCKS} more series")
        bound = [k for k, v in self.on_boundary.items() if bool(np.any(as_numpy(v)))]
        if bound:
            lines.append(f"on the boundary 0 (no standard error): {', '.join(bound)}")
        if self.reason and self.reason != self.message:
            lines.append(f"not converged: {self.reason}")
        return "\n".join(lines)


_REPR_BLOCKS = 8
METHOD_NAMES = {"lbfgs": "L-BFGS", "adam": "Adam"}


def as_numpy(x: Any) -> np.ndarray:
    """``x`` as a NumPy array (a tensor detached and moved to the host)."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _block_shape(est):
    shape = next(iter(est.values())).shape if est else ()
    return tuple(s for s in shape if s != 1) or (1,)
