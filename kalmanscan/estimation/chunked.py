"""The log-likelihood of :func:`kalmanscan.fit` and its exact gradient on a record longer than
memory, one time chunk at a time (``ks.fit`` of a dask array chunked along time, or of a
DataArray holding one).

``y`` is a dask array ``(..., T, C)`` whose chunks along time (axis ``-2``) are ``0 .. n-1``. Only
one chunk of ``y`` (all its series) and the belief at each chunk boundary (two numbers per series
and boundary) are held at a time:

- forward: chunk 0 is filtered from the prior, every later chunk from the filtered belief at the
  end of the one before (``ks.filter(..., state=)``: its prediction into the chunk's first step
  is the filter's own transition), so the chunks' log-likelihoods add up to the whole record's.
  Only the log-likelihood's sum and the boundary beliefs ``(mean, var)`` are kept;
- backward (checkpointing): from the last chunk back, each chunk is filtered again from its
  stored incoming belief under autograd and differentiated with ``torch.autograd.grad``, the
  cotangents being the log-likelihood's and the adjoint of the belief it hands on (what the next
  chunk's backward gave for its incoming belief). The parameters' gradients add up over the
  chunks; the adjoint of the incoming belief goes back to the chunk before.

The parameters enter every chunk's graph afresh: the transition into a chunk's first step, the
OU mean level the carried belief is centred on (:class:`kalmanscan.inference.stream.StreamState`)
and, for chunk 0, the prior are functions of them, so the gradient is that of the whole record's
log-likelihood (equal to the in-memory objective's to rounding, float64). Each evaluation reads
every chunk twice (forward and backward) and filters it twice.

:class:`ChunkedLikelihood` has the interface :func:`kalmanscan.fit` uses of
:class:`kalmanscan.estimation.likelihood.Likelihood` (a call, :meth:`ChunkedLikelihood.gradient`,
:meth:`ChunkedLikelihood.in_float64`); :func:`statistics` gives the data summaries the fit's
initial guesses read, from one pass over the chunks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kalmanscan.inference.filtering import filter as ks_filter
from kalmanscan.inference.stream import StreamState

__all__ = ["ChunkedLikelihood", "as_record", "statistics"]

def as_record(y: Any) -> Any:
    """``y`` as a dask array when it is one, or a DataArray holding one (read positionally as
    ``(..., T, C)``, its coordinates not read), else ``None`` (without importing dask)."""
    data = getattr(y, "data", None) if type(y).__module__.split(".")[0] == "xarray" else y
    return data if _is_dask(data) else None


def _is_dask(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "dask" and hasattr(x, "chunks") and hasattr(x, "compute")


def statistics(y: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per series ``B + (C,)``, over time, of the dask array ``y`` ``B + (T, C)`` in one pass over
    its chunks: ``observed`` (the count of non-NaN values), ``lo`` and ``hi`` (the smallest and
    largest observed value; ``inf`` and ``-inf`` without one), ``mean`` and ``var`` (NaN-aware
    mean and variance, ``ddof = 0``) and ``dvar`` (the variance of the differences of
    consecutive values; ``var`` for ``T = 1``), as ``dtype`` tensors."""
    import dask
    import dask.array as dsa

    _check_y(y)
    y = y.astype(np.float64)
    missing = dsa.isnan(y)
    diff = y[..., 1:, :] - y[..., :-1, :] if y.shape[-2] > 1 else y
    with warnings.catch_warnings():  # an all-NaN series' mean and variance are NaN, as torch's
        warnings.simplefilter("ignore", RuntimeWarning)
        values = dask.compute((~missing).sum(-2), dsa.where(missing, np.inf, y).min(-2),
                              dsa.where(missing, -np.inf, y).max(-2), dsa.nanmean(y, -2), dsa.nanvar(y, -2),
                              dsa.nanvar(diff, -2))
    names = ("observed", "lo", "hi", "mean", "var", "dvar")
    return {k: torch.as_tensor(np.asarray(v, dtype=np.float64), dtype=dtype) for k, v in zip(names, values)}


def _check_y(y: Any) -> None:
    """``ValueError`` naming ``y`` as :func:`kalmanscan.problem.prepare.prepare` raises it, before
    any chunk is read."""
    if y.ndim < 2:
        raise ValueError(f"y must have shape (..., T, C) with T >= 1 and C >= 1, got {tuple(y.shape)}")
    if y.shape[-2] < 1 or y.shape[-1] < 1:
        raise ValueError(f"y must have T >= 1 and C >= 1, got shape {tuple(y.shape)}")
    kind = np.dtype(y.dtype).kind
    if kind == "b":
        raise ValueError("y must be numeric observations, got a boolean array (convert it with "
                         "y.astype(float) if 0/1 values are really meant)")
    if kind not in "iuf":
        raise ValueError(f"y must be numeric, got dtype {y.dtype}")


class ChunkedLikelihood:
    """``loglik(nat) -> B + (C,)``: the exact log-likelihood per series of :func:`kalmanscan.filter`
    for the dask array ``y`` ``B + (T, C)`` chunked along time, where the estimated names take the
    values ``nat`` (each ``B + (Cp,)``, ``Cp`` = C or 1, static) and every other keyword is fixed
    (``fixed``: the given values of ``theta, sigma, obs_var, mean, init_mean, init_var``, static or
    per step ``B + (T, C)``, NumPy, torch or dask; ``h``, ``dt`` and ``times`` as
    :func:`kalmanscan.filter` takes them, per step ones cut along time with ``y``).

    Differentiable with respect to ``nat`` (module docstring: forward over the chunks,
    checkpointed backward). Computed in float64 (as :func:`kalmanscan.fit` computes NumPy input) on
    the CPU with ``backend`` (``"auto"``: the compiled loop).
    ``start`` (the estimated names' values) validates the inputs once, chunk by chunk: a
    ``ValueError`` names the argument as :func:`kalmanscan.filter` does."""

    numpy = None
    """No NumPy evaluation (the in-memory :class:`~kalmanscan.estimation.likelihood.Likelihood` has one)."""

    def __init__(self, y: Any, fixed: dict[str, Any], start: dict[str, torch.Tensor], *, h: Any = 1.0,
                 dt: Any = 1.0, times: Any = None, backend: str = "auto"):
        _check_y(y)
        self.y, self.fixed, self.names = y, dict(fixed), tuple(start)
        self.steps = dict(h=h, dt=dt, times=times)
        self.backend = backend
        self.dtype = torch.float64
        self.batch = tuple(y.shape[:-2])
        self.bounds = np.cumsum((0,) + tuple(int(c) for c in y.chunks[-2]))
        with torch.no_grad():
            self.forward_pass(dict(start), check=True)

    def __call__(self, nat: dict[str, torch.Tensor], graphed: bool = False) -> torch.Tensor:
        """The log-likelihood ``B + (C,)`` (``graphed`` is not used: no CUDA graph)."""
        return _Evaluate.apply(self, *(nat[k] for k in self.names))

    def gradient(self, nat: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
        """The gradient ``B + (Cp, P)`` of ``-loglik(nat).sum()`` with respect to ``names`` (in that
        order): one forward and one backward pass over the chunks."""
        values = [nat[k].detach() for k in self.names]
        with torch.no_grad():
            _, beliefs = self.forward_pass(dict(zip(self.names, values)))
        cotangent = torch.full(self.batch + (self.y.shape[-1],), -1.0, dtype=self.dtype)
        got = dict(zip(self.names, self.backward_pass(values, beliefs, cotangent)))
        return torch.stack([got[k] for k in names], -1)

    def in_float64(self) -> ChunkedLikelihood:
        """Itself: it is computed in float64."""
        return self

    def forward_pass(self, nat: dict[str, torch.Tensor], check: bool = False) -> tuple[torch.Tensor, list]:
        """The log-likelihood ``B + (C,)`` and the filtered belief ``(mean, var)`` at the end of
        every chunk but the last (what the backward re-filters each chunk from)."""
        total, beliefs, belief = 0.0, [], None
        for i in range(len(self.bounds) - 1):
            loglik, belief = self._chunk(i, nat, belief, check)
            total = total + loglik.double()
            if belief is not None:
                beliefs.append(belief)
        return total.to(self.dtype), beliefs

    def backward_pass(self, values: Sequence[torch.Tensor], beliefs: list, grad: torch.Tensor) -> list:
        """The gradient of ``(grad * loglik).sum()`` with respect to ``values`` (``nat`` in
        ``self.names``' order), chunk by chunk from the last (module docstring)."""
        leaves = [v.detach().requires_grad_(True) for v in values]
        nat = dict(zip(self.names, leaves))
        total = [torch.zeros_like(v) for v in leaves]
        adjoint = None
        for i in reversed(range(len(self.bounds) - 1)):
            incoming = None if i == 0 else tuple(x.detach().requires_grad_(True) for x in beliefs[i - 1])
            with torch.enable_grad():
                loglik, outgoing = self._chunk(i, nat, incoming)
            pairs = [(loglik, grad.to(loglik.dtype))]
            if adjoint is not None:
                pairs += list(zip(outgoing, adjoint))
            pairs = [(x, g) for x, g in pairs if x.requires_grad]
            inputs = leaves + list(incoming or ())
            gs = torch.autograd.grad([x for x, _ in pairs], inputs, [g for _, g in pairs],
                                     allow_unused=True) if pairs else [None] * len(inputs)
            total = [t if g is None else t + g for t, g in zip(total, gs)]
            adjoint = [torch.zeros_like(x) if g is None else g for x, g in zip(incoming or (), gs[len(leaves):])]
        return total

    def _chunk(self, i: int, nat: dict[str, torch.Tensor], belief: tuple | None, check: bool = False):
        """Chunk ``i`` filtered from ``belief`` (the filtered ``(mean, var)`` at the previous
        chunk's last step; the prior for chunk 0): its log-likelihood ``B + (C,)`` and the belief
        at its last step (``None`` for the last chunk)."""
        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        T = int(self.bounds[-1])
        y = torch.as_tensor(np.asarray(_cut(self.y, a, b, T)), dtype=self.dtype)
        kw = {k: _cut(v, a, b, T) for k, v in self.fixed.items()}
        kw.update({k: v if k.startswith("init_") else v.unsqueeze(-2) for k, v in nat.items()})
        kw.update(h=_cut(self.steps["h"], a, b, T), dt=_cut(self.steps["dt"], a, b, T),
                  times=_cut(self.steps["times"], a, b, T, times=True))
        if belief is not None:
            kw.pop("init_mean", None)
            kw.pop("init_var", None)
            kw["state"] = self._state(belief, nat, a, T)
        post = ks_filter(y, **kw, backend=self.backend, outputs=("mean", "var", "loglik"), check_finite=check)
        if b == T:
            return post.loglik, None
        var = post.var[..., -1, :].clone()  # not a view: the chunk's moments are freed
        level = self._level(nat, b - 1, T)
        mean = torch.where(torch.isinf(var), torch.zeros_like(var) + level, post.mean[..., -1, :])
        return post.loglik, (mean, var)

    def _state(self, belief: tuple, nat: dict, a: int, T: int) -> StreamState:
        """The belief at step ``a - 1`` as the stream state chunk ``a..`` continues."""
        mean, var = belief
        times = self.steps["times"]
        time = None if times is None else np.asarray(_cut(times, a - 1, a, T, times=True), np.float64)
        if time is not None and time.ndim >= 2:
            time = time[..., 0, :]  # (..., 1, 1) -> (..., 1)
        return StreamState(mean=mean, var=var, level=self._level(nat, a - 1, T), time=time, steps=a)

    def _level(self, nat: dict, t: int, T: int) -> Any:
        """The OU mean level at step ``t`` ``B + (C,)``-broadcastable, in the graph of ``nat``."""
        if "mean" in nat:
            return nat["mean"]
        level = torch.as_tensor(np.asarray(_cut(self.fixed.get("mean", 0.0), t, t + 1, T)), dtype=self.dtype)
        return level[..., 0, :] if level.ndim >= 2 else level


class _Evaluate(torch.autograd.Function):
    """The chunked log-likelihood as one autograd node: the forward keeps the boundary beliefs
    alone, the backward filters each chunk again from its own (checkpointing)."""

    @staticmethod
    def forward(ctx, lik: ChunkedLikelihood, *values: torch.Tensor) -> torch.Tensor:
        loglik, beliefs = lik.forward_pass(dict(zip(lik.names, values)))
        ctx.lik, ctx.beliefs = lik, beliefs
        ctx.save_for_backward(*values)
        return loglik

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *ctx.lik.backward_pass(ctx.saved_tensors, ctx.beliefs, grad))


def _cut(x: Any, a: int, b: int, T: int, times: bool = False) -> Any:
    """Steps ``a..b-1`` of ``x``: per step when ``ndim >= 2`` and its axis ``-2`` has length ``T``
    (or, for ``times``, a ``(T,)`` vector); anything else is static and returned as it is. A dask
    piece is computed (a NumPy array)."""
    if x is None or np.ndim(x) == 0:
        return x
    if times and np.ndim(x) == 1:
        piece = x[a:b]
    elif np.ndim(x) >= 2 and x.shape[-2] == T and T > 1:
        piece = x[..., a:b, :]
    else:
        return x
    return piece.compute() if _is_dask(piece) else piece
