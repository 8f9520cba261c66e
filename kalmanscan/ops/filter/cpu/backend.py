"""The ``"cpu"`` backend of :func:`kalmanscan.filter` and :func:`kalmanscan.smooth`: compiled
sequential loops, parallel over series.

On a CPU the time-parallel scan of the ``"torch"`` backend does several times the work of the
sequential recursion and streams every intermediate through memory. Here every series (a batch
index and channel) runs the covariance-form recursion of the ``"reference"`` backend as one
compiled loop over time, in numba (:mod:`kalmanscan.ops.filter.cpu.loops`; the adjoint in
:mod:`~kalmanscan.ops.filter.cpu.adjoint`, the smoother in :mod:`~kalmanscan.ops.filter.cpu.rts`),
threads taking blocks of series (``prange``): one pass over ``y``, the requested outputs written
once, nothing else of the full shape allocated. Outputs are allocated by NumPy, which asks the
kernel for huge pages for large arrays (first touching fresh memory in 4 KiB pages can cost more
than the loop that fills it), and shared with torch without a copy. The decay and noise are the
exact OU discretisation computed in the
loop with the operations of :func:`kalmanscan.model.ou.discretize` (once per series when ``theta,
sigma, dt`` are static). Static and broadcast parameters are read through their strides and
``y`` and the parameters through zero-copy NumPy views of the CPU tensors: nothing the caller
passed is copied or modified. Arithmetic is in the problem's dtype (float32 or float64).

Gradients: :class:`_Filter`, a ``torch.autograd.Function``, runs the reverse recursion of the
scalar adjoints (one compiled loop backwards in time over the forward's saved centred mean and
variance) for ``y``, ``decay, noise, obs_var, h, mean`` per step (or summed over time where the
parameter is static) and the initial belief; :func:`kalmanscan.model.ou.discretize_vjp` maps the decay
and noise adjoints to ``theta, sigma, dt`` (and so to ``times``), and every adjoint is reduced
to its parameter's broadcast shape. The backward is not itself differentiable: a
backward with ``create_graph=True`` raises ``RuntimeError`` (rather than silently treating the
adjoints as constants); the standard errors of :func:`kalmanscan.fit` take central differences
of this exact gradient instead (:mod:`kalmanscan.estimation.likelihood`). :func:`smooth` is the RTS
smoother as a compiled reverse loop with its own compiled adjoint (:class:`_Smooth`),
differentiable (once) like the filter.

Compilation: nothing is compiled or imported from numba until the first call; each of the five
loops (the filter with static parameters, with per-step ones, its adjoint, the smoother, its
adjoint) compiles on its first call per dtype (about 3 to 10 s of CPU each on a 2-core machine)
and is cached on disk beside its module (``__pycache__``, or ``NUMBA_CACHE_DIR``), so later
processes load it (about 0.4 s of CPU for numba's own start, then milliseconds a loop). Small
float64 work (at most :attr:`~kalmanscan.tuning.Tuning.numpy_work` element-steps, decided by size
alone) runs the forward, the derived fields and the smoother without gradients with the loops'
operations in Python floats and NumPy instead (:mod:`kalmanscan.ops.filter.cpu.small`): the same
bits, no numba, a few milliseconds for the first call of a process as for the others.

Threads: numba's (``numba.set_num_threads``); work below
:attr:`~kalmanscan.tuning.Tuning.small_work` steps, or a single series, runs on the calling
thread alone. Results do not depend on the thread count: each series
is computed by one thread with the same operations.
"""

from __future__ import annotations

from collections.abc import Sequence

import functools
import math

import numpy as np
import torch

from kalmanscan.model import ou
from kalmanscan.ops import host_memory
from kalmanscan.ops.cpu_threads import numba_thread_count, run_loop
from kalmanscan.problem.problem import Problem
from kalmanscan.ops.filter.cpu import small
from kalmanscan.ops.filter.torch import adjoint_to, compact

__all__ = ["filter", "smooth", "summary", "derived_fields", "DERIVED", "stream_step", "stream_step_arrays", "layout",
           "FIELDS", "POSTERIOR", "INPUTS", "SMOOTH_INPUTS"]

# The forward's outputs in the loops' order (cpu_loops.O_MEAN .. O_MISS).
FIELDS = ("mean", "var", "precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean",
          "pred_obs_var", "logliks", "missing")
POSTERIOR = FIELDS  # the rows of stream_step's out, as kalmanscan.ops.filter.triton.POSTERIOR for its kernel
INPUTS = ("y", "theta", "sigma", "dt", "obs_var", "mean", "h", "init_mean", "init_var")
SMOOTH_INPUTS = ("mean", "var", "pred_mean", "pred_var", "decay", "noise")  # the fields smooth() is given
MAX_LANES = 256     # series per task at most (a task walks time with its series innermost)
MIN_LANES = 8       # ... and at least this many while there are enough series (overlaps their latency)
TASKS_PER_THREAD = 4


def _loops():
    """The compiled loops' modules ``(forward, adjoint, smoother)`` (imports numba on the first call)."""
    from kalmanscan.ops.filter.cpu import adjoint as cpu_adjoint, loops as cpu_loops, rts as cpu_rts

    return cpu_loops, cpu_adjoint, cpu_rts


def _block(B: int, C: int) -> int:
    """Series per task (lanes): the ``B C`` series split into a multiple of the thread count of
    tasks, up to :data:`TASKS_PER_THREAD` per thread while each keeps :data:`MIN_LANES` lanes,
    and at most :data:`MAX_LANES` lanes a task. Results do not depend on it."""
    N = B * C
    threads = numba_thread_count()
    tasks = threads * max(1, min(TASKS_PER_THREAD, N // (threads * MIN_LANES)))
    return max(1, min(MAX_LANES, -(-N // tasks)))


def layout(xs: Sequence[torch.Tensor], shape: tuple[int, ...],
           dtype: torch.dtype) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
    """``(arrays, boff, tstride, cstride)`` of the loops for tensors broadcastable to ``shape``.

    ``arrays``: a 1-D NumPy view of each tensor's elements from its first one on (zero-copy,
    whatever its strides); ``boff``: ``(B, len(xs))`` element offsets of each flattened batch
    index; ``tstride, cstride``: element strides along time and channels (0 where broadcast).
    ``None`` stands for an input that is not read (a one-element placeholder).
    """
    nd = len(shape)
    batch = shape[:-2]
    B = math.prod(batch)
    boff = np.zeros((B, len(xs)), np.int64)
    tstride = np.zeros(len(xs), np.int64)
    cstride = np.zeros(len(xs), np.int64)
    arrays = []
    for i, x in enumerate(xs):
        if x is None or x.numel() == 0:  # not read (an empty input means no series to read it for)
            arrays.append(np.zeros(1, dtype))
            continue
        x = x.detach()
        if x.device.type != "cpu" or x.dtype != _TORCH[dtype] or x.ndim > nd:
            raise ValueError(f"cpu backend: expected a CPU {dtype} tensor of at most {nd} dimensions, "
                             f"got {x.dtype} on {x.device} with shape {tuple(x.shape)}")
        sizes = (1,) * (nd - x.ndim) + tuple(x.shape)
        strides = (0,) * (nd - x.ndim) + tuple(x.stride())
        if any(s not in (1, n) for s, n in zip(sizes, shape)):
            raise ValueError(f"cpu backend: shape {tuple(x.shape)} does not broadcast to {shape}")
        strides = tuple(0 if s == 1 else st for s, st in zip(sizes, strides))
        if x.is_contiguous():
            arrays.append(x.numpy().reshape(-1))
        else:
            extent = 1 + sum((s - 1) * st for s, st in zip(sizes, strides))
            arrays.append(torch.as_strided(x, (extent,), (1,), x.storage_offset()).numpy())
        if nd > 2:
            off = np.zeros((), np.int64)
            for d in range(nd - 2):
                off = np.add.outer(off, np.arange(shape[d], dtype=np.int64) * strides[d])
            boff[:, i] = off.reshape(-1)
        tstride[i], cstride[i] = strides[-2], strides[-1]
    return tuple(arrays), boff, tstride, cstride


_TORCH = {np.float32: torch.float32, np.float64: torch.float64}


def _np_dtype(dtype):
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"cpu backend computes in float32 or float64, got {dtype}")
    return np.float32 if dtype == torch.float32 else np.float64


def _check(p: Problem):
    if p.y.device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors; y is on {p.y.device}")
    return _np_dtype(p.dtype)


def _flat(x):
    """A contiguous CPU tensor as a 1-D NumPy view (no copy)."""
    return x.numpy().reshape(-1)


def _dims(shape):
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def _forward(inputs, shape, fields=FIELDS, save_zc=False):
    """Run the forward loop; returns ``({field: tensor of shape}, zc or None)``; ``"loglik"`` among
    ``fields``: also each series' log-likelihood summed over time in float64 by the loop, ``(..., C)``
    in the compute dtype (no per-step terms written for it)."""
    dtype = _np_dtype(inputs[0].dtype)
    B, T, C = _dims(shape)
    names = FIELDS + ("zc",)
    wanted = set(fields) | ({"zc"} if save_zc else set())
    out = {k: host_memory.empty(shape, inputs[0].dtype) for k in names if k in wanted}
    if small.small(dtype, shape):
        llsum = np.zeros(shape[:-2] + (C,), np.float64) if "loglik" in wanted else None
        small.forward(tuple(x.detach().numpy() for x in inputs), shape, {k: v.numpy() for k, v in out.items()}, llsum)
        if llsum is not None:
            out["loglik"] = torch.from_numpy(llsum)
        return out, out.pop("zc", None)
    L = _loops()[0]
    arrays, boff, tstride, cstride = layout(inputs, shape, dtype)
    placeholder = np.zeros(1, dtype)
    outs = tuple(_flat(out[k]) if k in out else placeholder for k in names)
    write = np.array([k in out for k in names])
    llsum = np.zeros(B * C, np.float64) if "loglik" in wanted else L.NO_SUMS
    trans_step = bool(tstride[[L.THETA, L.SIGMA, L.DT]].any())
    if B and (trans_step or tstride[[L.OBS_VAR, L.MEAN, L.H]].any()):
        run_loop(L.filter_forward, B * C, B * C * T, arrays, boff, tstride, cstride, outs, write,
                 L.constants(dtype), T, C, _block(B, C), trans_step, llsum)
    elif B:
        run_loop(L.filter_static, B * C, B * C * T, arrays, boff, tstride, cstride, outs, write,
                 L.constants(dtype), T, C, _block(B, C), llsum)
    if "loglik" in wanted:
        out["loglik"] = torch.from_numpy(llsum.reshape(shape[:-2] + (C,))).to(inputs[0].dtype)
    zc = out.pop("zc", None)
    return out, zc


def stream_step(y: torch.Tensor, belief: torch.Tensor, rows: torch.Tensor,
                fields: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``N`` streamed series (:class:`kalmanscan.StreamFilter`'s update on a CPU, the
    contract of :func:`kalmanscan.ops.filter.triton.stream_step`): ``y`` holds ``N`` values (any
    shape), ``belief`` ``(2, ...)`` their filtered mean and variance, ``rows`` ``(5, N)`` their
    ``decay, noise, obs_var, mean, h``, all in the compute dtype. Returns ``(out, new_belief)``:
    ``out`` ``(10, N)``, the rows of :data:`POSTERIOR` (all written, whatever ``fields`` names),
    ``new_belief`` ``(2, N)``. Two compiled loops and NumPy's ``log``
    (:mod:`kalmanscan.ops.filter.cpu.stream`); nothing given is written."""
    N = rows.shape[1]
    y, belief, rows = (x.detach().contiguous().numpy() for x in (y.reshape(N), belief.reshape(2, N), rows))
    out, new_belief = stream_step_arrays(y, belief, rows)
    return torch.from_numpy(out), torch.from_numpy(new_belief)


def stream_step_arrays(y: np.ndarray, belief: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`stream_step` on NumPy arrays, no torch operation: ``y`` ``(N,)``, ``belief``
    ``(2, N)``, ``rows`` ``(5, N)``, C-contiguous, of one float dtype; returns new ``out``
    ``(10, N)`` and ``new_belief`` ``(2, N)`` arrays of that dtype."""
    from kalmanscan.ops.filter.cpu import stream as cpu_stream

    N = rows.shape[1]
    inp = np.empty((len(cpu_stream.INPUTS), N), rows.dtype)
    inp[0], inp[1:3], inp[3:] = y, belief, rows
    out = np.empty((len(POSTERIOR), N), rows.dtype)
    k = _constants(rows.dtype)
    cpu_stream.stream_moments(inp, out, k)
    cpu_stream.stream_logliks(out, np.log(out[7]), k)
    return out, out[:2].copy()


@functools.cache
def _constants(dtype: np.dtype) -> np.ndarray:
    """The compiled loops' constants in ``dtype``, made once (:func:`cpu_loops.constants`)."""
    return _loops()[0].constants(dtype)


def _first_order_only():
    """Raise for a differentiable backward (``create_graph=True``): the compiled adjoints are not
    themselves differentiable, and treating them as constants would give wrong second
    derivatives silently."""
    if torch.is_grad_enabled():
        raise RuntimeError("backend='cpu' computes first derivatives only (its backward is a compiled loop); "
                           "use backend='torch' for second derivatives (create_graph=True)")


class _Filter(torch.autograd.Function):
    """``(y, theta, sigma, dt, obs_var, mean, h, init_mean, init_var) ->`` the ``fields`` asked
    for, a subset of :data:`FIELDS` in its order (``missing`` not differentiable); the forward
    writes those, the variance and the centred mean (the backward's), nothing else. Unused
    outputs reach the backward as ``None`` and their cotangents are skipped."""

    @staticmethod
    def forward(ctx, shape, fields, *inputs):
        out, zc = _forward(inputs, shape, tuple(k for k in FIELDS if k in fields or k == "var"), save_zc=True)
        ctx.shape, ctx.fields = shape, fields
        ctx.set_materialize_grads(False)
        if "missing" in fields:
            ctx.mark_non_differentiable(out["missing"])
        ctx.save_for_backward(*inputs, zc, out["var"])
        return tuple(out[k] for k in fields)

    @staticmethod
    def backward(ctx, *cot):
        _first_order_only()
        with torch.no_grad():
            return _Filter._backward(ctx, *cot)

    @staticmethod
    def _backward(ctx, *cot):
        L, A, _ = _loops()
        shape = ctx.shape
        *inputs, zc, var = ctx.saved_tensors
        dtype = _np_dtype(zc.dtype)
        B, T, C = _dims(shape)
        tdtype = zc.dtype
        needs = ctx.needs_input_grad[2:]
        given = dict(zip(ctx.fields, cot))
        cot = [given.get(k) for k in FIELDS[:L.N_COT]]
        if all(g is None for g in cot) or not any(needs):
            return (None,) * 11
        arrays, boff, tstride, cstride = layout(inputs, shape, dtype)
        cots = [None if g is None else g.to(tdtype) for g in cot]
        carrays, cboff, ctstride, ccstride = layout(cots, shape, dtype)
        has = np.array([g is not None for g in cots])
        trans_step = bool(tstride[[L.THETA, L.SIGMA, L.DT]].any())
        step = np.array([trans_step, trans_step] + [bool(tstride[i]) for i in (L.OBS_VAR, L.H, L.MEAN)])
        grads = [torch.empty((B, T if s else 1, C), dtype=tdtype) for s in step]
        gy = host_memory.empty(shape, tdtype)
        ginit = torch.empty((2, B * C), dtype=tdtype)
        if B:
            run_loop(A.filter_backward, B * C, B * C * T, arrays, boff, tstride, cstride, _flat(zc), _flat(var),
                     carrays, cboff, ctstride, ccstride, has, tuple(_flat(g) for g in grads), step, _flat(gy),
                     ginit.numpy(), L.constants(dtype), T, C, _block(B, C), trans_step)
        y, theta, sigma, dt, obs_var, mean, h, init_mean, init_var = inputs
        out = dict.fromkeys(INPUTS)
        if needs[0]:
            out["y"] = gy.sum_to_size(y.shape)
        for name, g, s, x in (("obs_var", grads[2], step[2], obs_var), ("h", grads[3], step[3], h),
                              ("mean", grads[4], step[4], mean)):
            if needs[INPUTS.index(name)]:
                out[name] = adjoint_to(g, shape, x)
        init_shape = shape[:-2] + (1, C)
        if needs[7]:
            out["init_mean"] = ginit[0].reshape(init_shape).sum_to_size(init_mean.shape)
        if needs[8]:
            out["init_var"] = ginit[1].reshape(init_shape).sum_to_size(init_var.shape)
        if any(needs[INPUTS.index(k)] for k in ("theta", "sigma", "dt")):
            steps = T if trans_step else 1
            tshape = shape[:-2] + (steps, C)
            got = ou.discretize_vjp(*(x.detach() for x in (theta, sigma, dt)),
                                    grads[0].reshape(tshape), grads[1].reshape(tshape))
            for k, g, x in zip(("theta", "sigma", "dt"), got, (theta, sigma, dt)):
                if needs[INPUTS.index(k)]:
                    out[k] = adjoint_to(g, shape, x)
        return (None, None, *(out[k] for k in INPUTS))


def filter(p: Problem, outputs: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Filter the validated problem ``p`` (CPU tensors) with the compiled loops; the contract of
    every backend's ``filter``: a dict of the :data:`FIELDS` and ``decay, noise``, tensors of the
    compute dtype broadcastable to ``p.shape`` (here the fields are contiguous ``p.shape``
    tensors; ``decay, noise`` are :meth:`Problem.decay_noise`'s, and only when no ``outputs``
    are named: with parameters per step they are ``p.shape`` tensors computed on the side, which
    the callers that name outputs take from the problem if they need them).

    Differentiable with respect to ``y``, every parameter and the initial belief (once: see the
    module docstring). ``outputs``, a subset of :data:`FIELDS` (default: those of ``p.outputs``,
    all when that is ``None``), writes only those fields (with gradients, also the variance and
    centred mean the backward reads); the dict then holds those and ``decay, noise``. ``"loglik"``
    among them (or among ``p.outputs`` without ``"logliks"``) adds each series' log-likelihood
    summed over time in float64, ``(..., C)`` (:data:`SUMS_LOGLIK`).
    """
    _check(p)
    if outputs is None and p.outputs is not None:
        outputs = [k for k in FIELDS if k in p.outputs]
        outputs += ["loglik"] if "loglik" in p.outputs and "logliks" not in p.outputs else []
    fields = FIELDS if outputs is None else tuple(outputs)
    unknown = set(fields) - {*FIELDS, "loglik"}
    if unknown:
        raise ValueError(f"outputs must be among {FIELDS} or 'loglik', got {sorted(unknown)}")
    inputs = tuple(getattr(p, k) for k in INPUTS)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        fields = tuple(k for k in FIELDS if k in fields or (k == "logliks" and "loglik" in fields))
        out = dict(zip(fields, _Filter.apply(p.shape, fields, *inputs)))
        if "loglik" in (outputs or ()):
            out["loglik"] = out["logliks"].sum(-2, dtype=torch.float64).to(p.dtype)
            if "logliks" not in outputs:
                del out["logliks"]
    else:
        out, _ = _forward(inputs, p.shape, fields)
    if outputs is None:
        out["decay"], out["noise"] = p.decay_noise()
    return out


SUMS_LOGLIK = True
"""``"loglik"`` among the outputs without ``"logliks"``: the loops sum each series' log-likelihood
(float64) and write no per-step terms for it (:func:`kalmanscan.filter` asks for it so)."""

DERIVED = ("precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean", "pred_obs_var", "logliks",
           "missing")


def derived_fields(p: Problem, mean: torch.Tensor, var: torch.Tensor) -> dict[str, torch.Tensor]:
    """The :data:`DERIVED` fields of ``p``'s filter from its filtered ``mean`` and ``var`` (CPU
    tensors broadcastable to ``p.shape``, the compute dtype) as contiguous ``p.shape`` tensors, in
    one compiled pass (:mod:`kalmanscan.ops.filter.cpu.derive`; small work in NumPy,
    :mod:`kalmanscan.ops.filter.cpu.small`, the same bits); not differentiable."""
    dtype = _check(p)
    inputs = tuple(getattr(p, k) for k in INPUTS) + (mean, var)
    if small.small(dtype, p.shape):
        fields = small.derive(tuple(x.detach().numpy() for x in inputs), p.shape)
        return {k: torch.from_numpy(fields[k]) for k in DERIVED}
    from kalmanscan.ops.filter.cpu import derive as cpu_derive

    L = _loops()[0]
    B, T, C = _dims(p.shape)
    arrays, boff, tstride, cstride = layout(inputs, p.shape, dtype)
    out = {k: host_memory.empty(p.shape, p.dtype) for k in DERIVED}
    if B:
        run_loop(cpu_derive.derive_fields, B * C, B * C * T, arrays, boff, tstride, cstride,
                 tuple(_flat(out[k]) for k in DERIVED), L.constants(dtype), T, C, _block(B, C),
                 bool(tstride[[L.THETA, L.SIGMA, L.DT]].any()))
    return out


def _rts_forward(inputs, shape, keep=False):
    """Smoothed ``(mean, var, precision)`` and, with ``keep``, the centred smoothed mean and the
    variance ratio the adjoint reads (else ``None``), from the loop inputs (``mean, var, level,
    pred_var, decay, noise``); small work without ``keep`` in NumPy
    (:mod:`kalmanscan.ops.filter.cpu.small`, the same bits)."""
    dtype = _np_dtype(inputs[0].dtype)
    if not keep and small.small(dtype, shape):
        out = tuple(host_memory.empty(shape, inputs[0].dtype) for _ in range(3))
        small.rts(tuple(x.detach().numpy() for x in inputs), shape, tuple(x.numpy() for x in out))
        return (*out, None)
    L, _, R = _loops()
    B, T, C = _dims(shape)
    arrays, boff, tstride, cstride = layout(inputs, shape, dtype)
    out = [host_memory.empty(shape, inputs[0].dtype) for _ in range(3 + 2 * keep)]
    flats = tuple(_flat(x) for x in out) + (() if keep else (np.zeros(1, dtype),) * 2)
    if B:
        run_loop(R.rts_forward, B * C, B * C * T, arrays, boff, tstride, cstride, flats, keep,
                 L.constants(dtype), T, C, _block(B, C))
    return (*out[:3], tuple(out[3:]) if keep else None)


class _Smooth(torch.autograd.Function):
    """``(mean, var, level, pred_var, decay, noise) -> (mean_s, var_s, precision_s)``."""

    @staticmethod
    def forward(ctx, shape, *inputs):
        mean_s, var_s, prec_s, (zs, rho) = _rts_forward(inputs, shape, keep=True)
        ctx.shape = shape
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs, zs, rho)
        return mean_s, var_s, prec_s

    @staticmethod
    def backward(ctx, *cot):
        _first_order_only()
        with torch.no_grad():
            return _Smooth._backward(ctx, *cot)

    @staticmethod
    def _backward(ctx, *cot):
        L, _, R = _loops()
        shape = ctx.shape
        *inputs, zs, rho = ctx.saved_tensors
        if all(g is None for g in cot):
            return (None,) * 7
        tdtype = zs.dtype
        dtype = _np_dtype(tdtype)
        B, T, C = _dims(shape)
        arrays, boff, tstride, cstride = layout(inputs, shape, dtype)
        cots = [None if g is None else g.to(tdtype) for g in cot]
        carrays, cboff, ctstride, ccstride = layout(cots, shape, dtype)
        has = np.array([g is not None for g in cots])
        step = np.array([bool(tstride[L.S_DECAY] or tstride[L.S_NOISE])])
        grads = [host_memory.empty(shape, tdtype) for _ in range(4)]
        grads += [torch.empty((B, T if step[0] else 1, C), dtype=tdtype) for _ in range(2)]
        if B:
            run_loop(R.rts_backward, B * C, B * C * T, arrays, boff, tstride, cstride, _flat(zs),
                     _flat(rho), carrays, cboff, ctstride, ccstride, has, tuple(_flat(g) for g in grads),
                     step, L.constants(dtype), T, C, _block(B, C))
        res = [g.sum_to_size(x.shape) for g, x in zip(grads[:4], inputs[:4])]
        res += [adjoint_to(g, shape, x) for g, x in zip(grads[4:], inputs[4:])]
        return (None, *(g if need else None for g, need in zip(res, ctx.needs_input_grad[1:])))


def smooth(f: dict[str, torch.Tensor], mean_param: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Smoothed ``(mean, var, precision)`` from the filter's tensors ``f`` (``mean, var,
    pred_mean, pred_var, decay, noise``, CPU tensors broadcastable to one ``(..., T, C)`` shape)
    and the OU mean ``mean_param`` (``None``: the means of ``f`` are centred) by the RTS recursion
    as a compiled reverse loop; the contract of every backend's ``smooth``.

    The mean is smoothed centred, ``z_s_t = e_t z_t + J_t z_s_{t+1}`` with non-negative
    coefficients (:mod:`kalmanscan.ops.filter.cpu.rts`), so ``pred_mean`` is not read: where ``f``'s
    means are centred to full precision (:func:`kalmanscan.smooth` passes them so) the result and
    its gradient keep it through any number of steps without process noise. Differentiable (once)
    with respect to every tensor of ``f`` and ``mean_param``.
    """
    level = torch.zeros((), dtype=f["mean"].dtype) if mean_param is None else mean_param
    inputs = (f["mean"], f["var"], level, f["pred_var"], f["decay"], f["noise"])
    if inputs[0].device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors; the filtered mean is on {inputs[0].device}")
    shape = tuple(np.broadcast_shapes(*(tuple(x.shape) for x in inputs)))
    dtype = inputs[0].dtype
    inputs = tuple(x.to(dtype) for x in inputs)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return _Smooth.apply(shape, *(compact(x) for x in inputs))
    return _rts_forward(inputs, shape)[:3]


def summary(p: Problem) -> tuple[torch.Tensor, ...]:
    """The merged-form product of every step of ``p`` with no transition at step 0: 7 tensors
    ``(..., 1, C)`` in ``p``'s dtype (computed in float64), the contract of the backends'
    ``summary`` (:mod:`kalmanscan.ops.filter`), forward only, composed in the compiled loop of
    :mod:`kalmanscan.ops.filter.cpu.summary` (imported, with numba, on the first call). ``p`` must
    be on the CPU."""
    from kalmanscan.ops.filter.cpu import summary as cpu_summary

    shape = p.shape
    T, C = shape[-2], shape[-1]
    batch = shape[:-2]
    n = math.prod(batch) * C
    with torch.no_grad():
        decay, noise = p.decay_noise()
        missing = torch.isnan(p.y)
        r = 1.0 / p.obs_var
        phi = torch.where(missing, 0.0, p.h * p.h * r)
        b = torch.where(missing, 0.0, p.h * r * (torch.where(missing, 0.0, p.y) - p.h * p.mean))

        def flat(x):
            x = torch.broadcast_to(x.to(torch.float64), shape)
            return np.ascontiguousarray(torch.movedim(x, -2, 0).reshape(T, n).numpy())

        out = np.empty((7, n))
        cpu_summary.product(flat(decay), flat(noise), flat(phi), flat(b), out)
    res = torch.from_numpy(out).to(p.dtype).reshape((7,) + batch + (C,))
    return tuple(x.unsqueeze(-2) for x in res.unbind(0))
