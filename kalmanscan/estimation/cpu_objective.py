"""The log-likelihood that :func:`kalmanscan.fit` maximises and its exact gradient on the ``"cpu"``
backend, without torch: float64 NumPy buffers prepared once, the compiled forward and adjoint
loops (:mod:`~kalmanscan.ops.filter.cpu.loops`, :mod:`~kalmanscan.ops.filter.cpu.adjoint`) run on
them directly, and the chain rule from the loops' adjoints to the estimated parameters in NumPy.

:class:`NumpyLikelihood` evaluates what :class:`kalmanscan.estimation.likelihood.Likelihood` does on a
float64 CPU problem: the estimated names replace the problem's fields (as static ``B + (1,
Cp)`` fields), an ``init_var`` neither given nor estimated is the stationary variance
``sigma^2 / (2 theta)``, an ``init_mean`` neither given nor estimated is ``mean``, and a diffuse
prior runs through the finite problem of :func:`kalmanscan.inference.diffuse.finite_problem` (the prior
becomes the belief after each channel's first observation ``f``, ``y`` is missing up to ``f``
and the transitions into steps ``1..f`` are the identity). The gradient follows the same
operations backwards: the adjoints of ``decay, noise`` map to ``theta, sigma`` through
:func:`kalmanscan.model.ou.discretize_vjp`, the initial belief's adjoints to the stationary variance or
to ``obs_var, mean`` at the first observation. Values and gradients equal the torch-driven path
to float64 rounding (``tests/test_fit_objective.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kalmanscan.model import ou
from kalmanscan.problem.problem import Problem
from kalmanscan import tuning
from kalmanscan.ops.filter.cpu.backend import FIELDS, INPUTS, MAX_LANES, MIN_LANES, layout
from kalmanscan.ops.cpu_threads import numba_thread_count, numba_threads

__all__ = ["NumpyLikelihood"]

_MODEL = ("theta", "sigma", "obs_var", "mean")


class NumpyLikelihood:
    """``evaluate(nat, cot) -> (loglik B + (C,), {name: gradient B + (Cp,)})`` for the float64 CPU
    problem ``p`` (validated, as :class:`kalmanscan.estimation.likelihood.Likelihood` holds it) where the
    estimated ``names`` take the values ``nat`` (NumPy, each ``B + (Cp,)``).

    ``stationary_init``: ``init_var`` is the stationary variance of the current ``theta, sigma``;
    ``mean_init``: ``init_mean`` is the current ``mean``. The log-likelihood is summed over time;
    the gradient is that of ``sum(cot * loglik)`` (``cot``: ``B + (C,)``, or broadcastable to it with
    at least one dimension).
    ``nat`` is not checked (the caller keeps it in the domain) and not modified.
    """

    def __init__(self, p: Problem, names: tuple[str, ...], stationary_init: bool, mean_init: bool):
        from kalmanscan.ops.filter.cpu import adjoint as cpu_adjoint, loops as cpu_loops

        self.loops, self.adjoint = cpu_loops, cpu_adjoint
        self.names, self.stationary_init, self.mean_init = tuple(names), stationary_init, mean_init
        self.shape = tuple(p.shape)
        *batch, T, C = self.shape
        self.bshape = tuple(batch) + (1, C)
        self.fixed = {k: getattr(p, k).detach() for k in INPUTS}
        self.np_fixed = {k: v.numpy() for k, v in self.fixed.items()}
        self.diffuse = p.diffuse
        y = np.broadcast_to(self.np_fixed["y"], self.shape)
        seen = ~np.isnan(y)
        self.first = np.where(seen.any(-2, keepdims=True), seen.argmax(-2)[..., None, :], T)
        self.at = np.minimum(self.first, T - 1)
        self.steps = np.arange(T).reshape(T, 1)
        N = math.prod(batch) * C
        self.N, self.T, self.C = N, T, C
        self.consts = cpu_loops.constants(np.float64)
        self.out = {k: np.empty(N * T) for k in ("var", "logliks", "zc")}
        self.placeholder = np.zeros(1)
        self.write = np.array([k in self.out for k in FIELDS + ("zc",)])
        self.cot = np.zeros(self.bshape)
        self.gy = np.empty(N * T)
        self.ginit = np.empty((2, N))
        self.has = np.arange(cpu_loops.N_COT) == cpu_loops.O_LL
        self.mask, self.nat_shape, self.ready = None, None, False
        # whether the diffuse channels (inf init_var) can change with the estimated values
        self.mask_moves = "init_var" in self.names or stationary_init and bool({"theta", "sigma"} & set(self.names))

    def _pick(self, x: np.ndarray) -> np.ndarray:
        """``x`` (broadcastable to the problem's shape) at each channel's first observation
        (broadcastable to ``bshape``)."""
        if x.ndim < 2 or x.shape[-2] == 1:
            return x
        return np.take_along_axis(np.broadcast_to(x, self.shape), self.at, -2)

    def _structure(self, mask: np.ndarray | None) -> None:
        """Buffers and the loops' layout for the diffuse channels ``mask`` (``None``: no diffuse prior)."""
        self.mask, self.ready = mask, True
        T = self.T
        y, hold = self.fixed["y"], None
        if mask is not None:
            upto = mask & (self.steps <= self.first)
            y = torch.from_numpy(np.where(upto, np.nan, np.broadcast_to(self.np_fixed["y"], self.shape)))
            if bool((mask & (self.first < T) & (self.first > 0)).any()):
                hold = mask & (self.steps <= self.first) & (self.steps > 0)
        self.hold = hold
        if mask is not None:
            self.observed = mask & (self.first < T)
            self.h_first = np.where(self.observed, self._pick(self.np_fixed["h"]), 1.0)
            self.y_first = self._pick(self.np_fixed["y"])
        self.buf = {k: np.empty(self.bshape) for k in ("init_mean", "init_var")}
        for k in _MODEL:
            if hold is not None and k in ("theta", "sigma"):
                self.buf[k] = np.empty(self.shape)
            elif k in self.names:
                self.buf[k] = np.empty(self.bshape[:-1] + self.nat_shape[-1:])
        inputs = [torch.from_numpy(self.buf[k]) if k in self.buf else self.fixed[k] for k in INPUTS]
        inputs[0] = y
        self.inputs = inputs
        self.arrays, self.boff, self.tstride, self.cstride = layout(inputs, self.shape, np.float64)
        L = self.loops
        self.trans_step = bool(self.tstride[[L.THETA, L.SIGMA, L.DT]].any())
        self.static = not (self.trans_step or self.tstride[[L.OBS_VAR, L.MEAN, L.H]].any())
        step = [self.trans_step, self.trans_step] + [bool(self.tstride[i]) for i in (L.OBS_VAR, L.H, L.MEAN)]
        self.step = np.array(step)
        self.grads = tuple(np.empty(self.N * (T if s else 1)) for s in step)
        self.carrays, self.cboff, self.ctstride, self.ccstride = layout(
            [None] * (L.N_COT - 1) + [torch.from_numpy(self.cot)], self.shape, np.float64)

    def _model(self, nat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The problem's (not yet finite) fields ``theta .. init_var`` at ``nat``."""
        v = {k: nat[k][..., None, :] if k in nat else self.np_fixed[k] for k in _MODEL}
        for k in ("init_mean", "init_var"):
            v[k] = nat[k][..., None, :] if k in nat else self.np_fixed[k]
        if self.stationary_init and ("theta" in nat or "sigma" in nat):
            with np.errstate(divide="ignore"):
                v["init_var"] = v["sigma"][..., :1, :] * v["sigma"][..., :1, :] / (2.0 * v["theta"][..., :1, :])
        if self.mean_init and "mean" in nat:
            v["init_mean"] = v["mean"]
        return v

    def evaluate(self, nat: dict[str, np.ndarray],
                 cot: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray] | None]:
        """The log-likelihood per series ``B + (C,)`` and, when ``cot`` is given, the gradient of
        ``sum(cot * loglik)`` per estimated name (``B + (Cp,)``; ``None`` without ``cot``)."""
        self.nat_shape = next(iter(nat.values())).shape
        v = self._model(nat)
        mask = self.mask
        if self.diffuse and (self.mask_moves or not self.ready):
            mask = np.isinf(np.broadcast_to(v["init_var"], self.bshape))
        if not self.ready or (mask is not self.mask and not np.array_equal(mask, self.mask)):
            self._structure(mask)
        self._finite(v, mask)
        one = self.N * self.T < tuning.current().small_work or self.N == 1
        threads = numba_thread_count()
        W = min(MAX_LANES, self.N) if one else max(1, min(MAX_LANES, max(MIN_LANES, -(-self.N // (4 * threads)))))
        with numba_threads(1 if one else None):
            self._forward(W)
            ll = self.out["logliks"].reshape(self.shape).sum(-2)
            if cot is None:
                return ll, None
            self.cot[...] = np.expand_dims(cot, -2)
            self._backward(W)
        return ll, self._chain(v)

    def _finite(self, v: dict, mask: np.ndarray | None) -> None:
        """Fill the buffers with the finite problem's fields."""
        b = self.buf
        im, iv = v["init_mean"], v["init_var"]
        if mask is not None:
            observed, h = self.observed, self.h_first
            centred = np.where(observed, (self.y_first - h * self._pick(v["mean"])) / h, 0.0)
            im = np.where(mask, v["mean"][..., :1, :] + centred, im)
            iv = np.where(mask, np.where(observed, self._pick(v["obs_var"]) / (h * h), 1.0), iv)
        b["init_mean"][...] = im
        b["init_var"][...] = iv
        for k in _MODEL:
            if k in b:
                b[k][...] = v[k] if self.hold is None or k not in ("theta", "sigma") else \
                    np.where(self.hold, 0.0, np.broadcast_to(v[k], self.shape))

    def _forward(self, W: int) -> None:
        L = self.loops
        outs = tuple(self.out[k] if k in self.out else self.placeholder for k in FIELDS + ("zc",))
        args = (self.arrays, self.boff, self.tstride, self.cstride, outs, self.write, self.consts, self.T, self.C, W)
        if self.static:
            L.filter_static(*args, L.NO_SUMS)
        else:
            L.filter_forward(*args, self.trans_step, L.NO_SUMS)

    def _backward(self, W: int) -> None:
        self.adjoint.filter_backward(self.arrays, self.boff, self.tstride, self.cstride, self.out["zc"],
                                     self.out["var"], self.carrays, self.cboff, self.ctstride, self.ccstride, self.has,
                                     self.grads, self.step, self.gy, self.ginit, self.consts, self.T, self.C, W,
                                     self.trans_step)

    def _chain(self, v: dict) -> dict[str, np.ndarray]:
        """The gradient per estimated name from the loops' adjoints (module docstring)."""
        L = self.loops
        batch, T, C, names = self.shape[:-2], self.T, self.C, self.names

        def adj(i, keep=False):  # summed over time unless kept: every estimated name is static
            x = self.grads[i].reshape(batch + ((T if self.step[i] else 1), C))
            return x if keep else x.sum(-2, keepdims=True)

        g_im, g_iv = self.ginit.reshape((2,) + self.bshape)
        g = {k: adj(i) for k, i in (("obs_var", L.G_R), ("mean", L.G_M)) if k in names}
        if self.mask is not None:
            mask, observed, h = self.mask, self.observed, self.h_first
            if "mean" in g:
                g["mean"] = g["mean"] + np.where(mask, g_im, 0.0) - (np.where(observed, g_im, 0.0) / h) * h
            if "obs_var" in g:
                g["obs_var"] = g["obs_var"] + np.where(observed, g_iv, 0.0) / (h * h)
            g_im, g_iv = np.where(mask, 0.0, g_im), np.where(mask, 0.0, g_iv)
        if "theta" in names or "sigma" in names:
            theta, sigma, dt = v["theta"], v["sigma"], self.np_fixed["dt"]  # broadcast by the adjoints' shape
            g_a, g_q = adj(L.G_A, True), adj(L.G_Q, True)
            if self.hold is not None:
                g_a, g_q = np.where(self.hold, 0.0, g_a), np.where(self.hold, 0.0, g_q)
            g_theta, g_sigma, _ = ou.discretize_vjp(theta, sigma, dt, g_a, g_q)
            g["sigma"] = g_sigma.sum(-2, keepdims=True)
            if "theta" in names:
                g["theta"] = g_theta.sum(-2, keepdims=True)
            if self.stationary_init:
                th, si = theta[..., :1, :], sigma[..., :1, :]
                g["sigma"] = g["sigma"] + g_iv / (2.0 * th) * si * 2.0
                if "theta" in g:
                    g["theta"] = g["theta"] - g_iv * (si * si / (2.0 * th)) / th
        if self.mean_init and "mean" in names:
            g["mean"] = g["mean"] + g_im
        g["init_mean"], g["init_var"] = g_im, g_iv
        out = {}
        for k in names:
            x = g[k].sum(-2)
            out[k] = x.sum(-1, keepdims=True) if self.nat_shape[-1] == 1 and C > 1 else x
        return out
