"""``ks.StreamFilter``: a stream filtered as it arrives, its parameters checked once.

``ks.filter(y_chunk, ..., state=state)`` continues a stream exactly (:mod:`kalmanscan.inference.stream`),
but every call validates and moves its parameters again, predicts the state through the
validated transition and builds a :class:`~kalmanscan.Posterior`: a fixed cost that dominates
when a call brings one step of a few thousand sensors. A :class:`StreamFilter` pays it once.
The first :meth:`~StreamFilter.update` is that public call (every check, a diffuse prior
included) and keeps the validated parameters; each later one predicts the state with the
stored ``decay, noise`` (a few elementwise operations on ``(..., C)``) and runs the backend on the
new steps directly; on the triton backend a one-step update is one kernel launch that predicts and
updates every series (:mod:`kalmanscan.kernels.filter.stream`), on the cpu backend one compiled
loop (:func:`kalmanscan.ops.filter.cpu.stream_step`). The result is the same filter:
chunk by chunk equals one call over the whole series to float rounding, on every backend
(``tests/test_stream_filter.py``).

Parameters are the stream's: static (scalars, ``(C,)``, or ``(..., 1, C)``), with a regular
``dt``; per-step parameters and irregular ``times`` take ``ks.filter(..., state=)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kalmanscan.inference.filtering import OUTPUTS, filter as _public_filter
from kalmanscan.problem.checks import check_no_inf, decide_y
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter import get_backend, resolve_backend, run_backend
from kalmanscan.inference.stream import StreamState, predict
from kalmanscan.types import ArrayLike

__all__ = ["StreamFilter"]

class StreamFilter:
    """Filter a stream of observations as they arrive: ``update(y)`` per new step(s).

    Args:
        theta, sigma, obs_var, mean, h, dt: the OU prior and observation model, as
            :func:`kalmanscan.filter`; static (scalars, ``(C,)`` or ``(..., 1, C)``).
        init_mean, init_var: the prior at the first step, as :func:`kalmanscan.filter`
            (``init_var = inf``: diffuse; updates take the public call's path until every
            channel has been observed).
        outputs: the fields :meth:`update` returns, a subset of ``mean, var, precision,
            pred_mean, pred_var, pred_precision, pred_obs_mean, pred_obs_var, logliks``
            (``"mean"`` and ``"var"`` are always computed: they are the state).
        backend: as :func:`kalmanscan.filter`.
        check_finite: as :func:`kalmanscan.filter` (``False``: no synchronisation per update).

    The first :meth:`update` fixes the stream's batch shape, channels, array kind, dtype and
    device; later ones must match them. :attr:`state` is the :class:`~kalmanscan.StreamState`
    after the last update (``ks.filter(..., state=f.state)`` continues it), :attr:`loglik` the
    log-likelihood ``(..., C)`` of everything filtered so far (summed in float64).

    Example::

        f = ks.StreamFilter(theta=0.1, sigma=0.5, obs_var=1.0)
        for y_t in sensor_readings:            # each (C,): one step of C sensors
            out = f.update(y_t)                # out["mean"], out["var"]: (C,)
    """

    def __init__(self, *, theta: ArrayLike, sigma: ArrayLike, obs_var: ArrayLike, mean: ArrayLike = 0.0,
                 h: ArrayLike = 1.0, dt: ArrayLike = 1.0, init_mean: ArrayLike | None = None,
                 init_var: ArrayLike | None = None, outputs: Sequence[str] = ("mean", "var"),
                 backend: str = "auto", check_finite: bool = True):
        params = dict(theta=theta, sigma=sigma, obs_var=obs_var, mean=mean, h=h, dt=dt)
        for name, value in params.items():
            if np.ndim(value) >= 2 and np.shape(value)[-2] != 1:
                raise ValueError(f"{name} must be static (a scalar, (C,) or (..., 1, C)) in a StreamFilter, "
                                 f"got shape {np.shape(value)}; per-step parameters take ks.filter(..., state=)")
        if isinstance(outputs, str) or not set(outputs) <= set(OUTPUTS) - {"loglik", "missing"}:
            raise ValueError(f"outputs must be a sequence of field names from "
                             f"{tuple(k for k in OUTPUTS if k not in ('loglik', 'missing'))}, got {outputs!r}")
        self._params, self._init = params, dict(init_mean=init_mean, init_var=init_var)
        self.outputs = tuple(outputs)
        self._fields = tuple(k for k in OUTPUTS if k in set(outputs) | {"mean", "var", "logliks"})
        self.backend, self.check_finite = backend, check_finite
        self._problem = None          # the validated parameters of one step, once the stream has started
        self._level = self._decay = self._noise = None
        self._belief = None           # the state: mean and variance, (2, ..., 1, C), compute dtype
        self._stepper = None          # the backend module whose stream_step runs one-step updates
        self._rows = None             # (5, N) decay, noise, obs_var, mean, h: the one-step kernel's
        self._rows_np = None          # the same as a NumPy array: NumPy streams on the cpu backend
        self._diffuse = False
        self._loglik = None
        self._steps = 0

    @property
    def state(self) -> StreamState | None:
        """The belief after the last update (``None`` before the first)."""
        if self._problem is None:
            return None
        p = self._problem
        return StreamState(mean=p.output(self._mean[..., 0, :]), var=p.output(self._var[..., 0, :]),
                           level=p.output(self._level[..., 0, :].expand_as(self._mean[..., 0, :])),
                           steps=self._steps)

    @property
    def _mean(self):
        return self._belief[0]

    @property
    def _var(self):
        return self._belief[1]

    @property
    def loglik(self) -> Any:
        """Log-likelihood ``(..., C)`` of every step so far (``None`` before the first update)."""
        return None if self._problem is None else self._problem.output(self._loglik.to(self._problem.dtype))

    def update(self, y: ArrayLike) -> dict[str, Any]:
        """Filter one new step ``y`` of shape ``(..., C)``. Returns ``{field: array}`` for
        :attr:`outputs`, each ``(..., C)``, in ``y``'s array kind."""
        return self._run(y, one_step=True)

    def extend(self, y: ArrayLike) -> dict[str, Any]:
        """Filter ``k`` new steps ``y`` of shape ``(..., k, C)``. Returns ``{field: array}`` for
        :attr:`outputs`, each ``(..., k, C)``."""
        return self._run(y, one_step=False)

    def _run(self, y: ArrayLike, one_step: bool) -> dict[str, Any]:
        if self._problem is None or self._diffuse:
            return self._public(y, one_step)
        p0 = self._problem
        if one_step and self._rows_np is not None:
            return self._numpy_step(y, p0)
        if one_step and self._rows is not None and not self._tracks_grad(y):
            return self._step(y, p0)
        y_t = self._steps_of(y, p0, one_step)
        init_mean, init_var = predict(self._level, self._decay, self._noise, self._mean - self._level, self._var)
        shape = tuple(p0.shape[:-2]) + tuple(y_t.shape[-2:])  # the batch of y and the parameters
        p = dataclasses.replace(p0, y=y_t, shape=shape, init_mean=init_mean, init_var=init_var,
                                outputs=self._fields, y_check=self.check_finite)
        out = run_backend(p, self.backend)
        queued = out.pop("y_check", None)
        if self.check_finite:
            decide_y(y_t, queued, out["logliks"])
        self._advance_state(out)
        return {k: p.output(out[k][..., 0, :] if one_step else out[k]) for k in self.outputs}

    def _public(self, y: ArrayLike, one_step: bool) -> dict[str, Any]:
        """An update through :func:`kalmanscan.filter` (the first, and while the prior is diffuse)."""
        if one_step:
            if np.ndim(y) < 1:
                raise ValueError(f"y must have shape (..., C) for one step, got {np.shape(y)}")
            y = y.unsqueeze(-2) if isinstance(y, torch.Tensor) else np.expand_dims(np.asarray(y), -2)
        elif np.ndim(y) >= 2 and np.shape(y)[-2] == 0:
            raise ValueError(f"y must hold at least one step, got shape {np.shape(y)}")
        state = self.state
        post = _public_filter(y, **self._params, **({} if state is not None else self._init),
                              backend=self.backend, outputs=self._fields, check_finite=self.check_finite,
                              state=state)
        if self._problem is None:
            first = y[..., :1, :]
            p0 = prepare(first, **self._params, init_var=1.0, backend=self.backend, check_y=False)
            self._problem, self._level = p0, p0.mean[..., :1, :]
            self._decay, self._noise = (x[..., :1, :] for x in p0.decay_noise())
        p0 = self._problem
        out = {k: getattr(post, k) for k in self._fields}
        self._advance_state({k: torch.as_tensor(v).to(device=p0.y.device, dtype=p0.dtype) for k, v in out.items()})
        self._diffuse = bool(torch.isinf(self._var).any())
        backend = resolve_backend(self.backend, p0.y.device)
        if self._rows is None and (backend == "cpu" or backend == "triton" and not p0.no_process_noise()):
            batch = p0.shape[:-2] + (1, p0.shape[-1])
            rows = (self._decay, self._noise, p0.obs_var, p0.mean, p0.h)
            self._rows = torch.stack([x[..., :1, :].expand(batch).reshape(-1) for x in rows])
            self._stepper = get_backend(backend)
            if backend == "cpu" and p0.numpy_out:
                self._rows_np = self._rows.numpy()
        return {k: out[k][..., 0, :] if one_step else out[k] for k in self.outputs}

    def _tracks_grad(self, y: ArrayLike) -> bool:
        """Whether an update of ``y`` must be differentiable: the stored one-step kernels and loops
        are not (they would drop the gradient silently), so such updates take the backend's filter."""
        return torch.is_grad_enabled() and (self._rows.requires_grad or self._belief.requires_grad
                                            or isinstance(y, torch.Tensor) and y.requires_grad)

    def _step(self, y: ArrayLike, p0) -> dict[str, Any]:
        """A one-step update on the triton or cpu backend: one launch of the stream kernel, or one
        compiled loop."""
        backend = self._stepper

        y_t = self._steps_of(y, p0, one_step=True)
        shape = p0.shape[:-2] + y_t.shape[-1:]
        out, belief = backend.stream_step(y_t.expand(p0.shape[:-2] + y_t.shape[-2:]), self._belief,
                                          self._rows, self._fields)
        rows = dict(zip(backend.POSTERIOR, out.view(out.shape[:1] + shape).unbind(0)))  # one view op
        logliks = rows["logliks"]
        if self.check_finite:  # by result: one step's kernel takes less than a reduction queued ahead
            decide_y(y_t, None, logliks)
        self._belief = belief.view(self._belief.shape)
        self._loglik = self._loglik + logliks
        self._steps += 1
        return {k: p0.output(rows[k]) for k in self.outputs}

    def _numpy_step(self, y: ArrayLike, p0) -> dict[str, Any]:
        """A one-step update of a NumPy stream on the cpu backend, in NumPy: the compiled loop on
        the stored state's memory, no torch operation (:func:`kalmanscan.ops.filter.cpu.stream_step_arrays`)."""
        backend, rows = self._stepper, self._rows_np
        _check_kind(y, p0)
        y_np = np.asarray(y)
        _check_one_step(y_np.shape, p0)
        shape = tuple(p0.shape[:-2]) + (p0.y.shape[-1],)
        if y_np.shape != shape or y_np.dtype != rows.dtype or not y_np.flags.c_contiguous:
            y_np = np.ascontiguousarray(np.broadcast_to(y_np, shape), dtype=rows.dtype)
        y_np = y_np.reshape(-1)
        out, belief = backend.stream_step_arrays(y_np, self._belief.numpy().reshape(2, -1), rows)
        logliks = out[backend.POSTERIOR.index("logliks")].reshape(shape)
        if self.check_finite and not np.isfinite(logliks.sum()):  # by result, as decide_y
            check_no_inf(y_np)
        self._belief = torch.from_numpy(belief.reshape(self._belief.shape))  # a NumPy reshape: no torch op
        self._loglik = torch.from_numpy(self._loglik.numpy() + logliks)
        self._steps += 1
        return {k: out[backend.POSTERIOR.index(k)].reshape(shape).astype(p0.out_dtype, copy=False)
                for k in self.outputs}

    def _steps_of(self, y: ArrayLike, p0, one_step: bool) -> torch.Tensor:
        """``y`` as a ``(..., k, C)`` tensor of the stream's dtype and device; ``ValueError`` naming
        ``y`` when its shape or array kind does not match the stream's."""
        _check_kind(y, p0)
        y_t = torch.as_tensor(y).to(device=p0.y.device, dtype=p0.dtype)
        batch, C = tuple(p0.y.shape[:-2]), p0.y.shape[-1]
        if one_step:
            _check_one_step(tuple(y_t.shape), p0)
            return y_t.unsqueeze(-2)
        if y_t.ndim != len(batch) + 2 or tuple(y_t.shape[:-2]) != batch or y_t.shape[-1] != C:
            raise ValueError(f"y must have shape {batch + ('k', C)}, as the stream's first update; "
                             f"got {tuple(y_t.shape)}")
        if y_t.shape[-2] == 0:
            raise ValueError(f"y must hold at least one step, got shape {tuple(y_t.shape)}")
        return y_t

    def _advance_state(self, out: dict[str, torch.Tensor]) -> None:
        """The state at the last step of ``out`` and the running log-likelihood."""
        self._belief = torch.stack([out["mean"][..., -1:, :], out["var"][..., -1:, :]])
        total = out["logliks"].sum(-2, dtype=torch.float64)
        self._loglik = total if self._loglik is None else self._loglik + total
        self._steps += out["mean"].shape[-2]


def _check_kind(y: ArrayLike, p0) -> None:
    """``ValueError`` naming ``y`` unless it is the array kind of the stream's first update."""
    if isinstance(y, torch.Tensor) == p0.numpy_out:
        raise ValueError(f"y must be a {'NumPy array' if p0.numpy_out else 'torch tensor'}, as the "
                         "stream's first update")


def _check_one_step(shape: tuple, p0) -> None:
    """``ValueError`` naming ``y`` unless ``shape`` is one step ``(..., C)`` of the stream."""
    want = tuple(p0.y.shape[:-2]) + (p0.y.shape[-1],)
    if tuple(shape) != want:
        raise ValueError(f"y must have shape {want} for one step, as the stream's first update; got {tuple(shape)}")
