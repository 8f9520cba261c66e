"""Static parameters given as GPU tensors, checked and derived in one launch.

:func:`kalmanscan.problem.prepare.prepare` checks parameters given on the host with NumPy. Where one of
them is a tensor on the device (a fitted or learned parameter), its torch path ran about seventy
small operations a call (checks, the stationary variance, the discretisation for the path's facts,
the moves of the host values), each a launch and host work: a call took 2-10x its kernels
(docs/performance.md). Here, for static parameters (each a scalar or ``(C,)``) with ``y`` on a GPU
and no ``times``: the values given on the host (zeros for an initial belief not given) move in one
copy (once for a layout and values, then kept on the device), all eight rows are stacked into one
``(8, C)`` block (differentiably: ``stack`` of the caller's tensors), and one program
(:func:`kalmanscan.kernels.filter.params.param_rows_kernel`) checks every row, computes the
initial belief, ``decay, noise, lam0, eta0`` in float64 and the path's facts. The verdicts are
queued on the caller's :class:`~kalmanscan.problem.checks.Checks`, in the order and with the messages of
the torch path. Where a parameter requires a gradient, the initial variance that depends on it is
recomputed by torch operations (differentiable) and the derived rows are not kept.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kalmanscan.model import mobius, ou
from kalmanscan.problem.checks import Checks, Flag
from kalmanscan.problem.bounds import (BOUNDS, NEEDS_INIT_VAR_SIGMA, NEEDS_INIT_VAR_THETA, NOISE_OVERFLOW, PARAMS,
                                       STATIONARY_OVERFLOW, kernel_codes, overflow_message, requirement)
from kalmanscan.problem.convert import broadcast_init, broadcast_param, host_array, on_host, to_device
from kalmanscan.problem.problem import Problem
from kalmanscan.problem.remembered import Remembered, value_key
from kalmanscan.types import ArrayLike

__all__ = ["static_on_device", "prepare_static"]

_ROWS = PARAMS + ("init_mean", "init_var")
_BLOCK, _WARPS = 1024, 16
"""The rows kernel's block of channels and warps: its one program is bound by the latency of its
float64 arithmetic, which more warps hide (H100, C = 4096: 26.9 us with 4 warps, 11.5 with 16;
C = 131072: 751 and 250 us)."""


def static_on_device(y: torch.Tensor, values: dict, times: ArrayLike | None) -> bool:
    """Whether :func:`prepare_static` takes these inputs: ``y`` on a GPU, no ``times``, and every one
    of ``values`` (the six parameters, ``init_mean``, ``init_var``) ``None``, a scalar or ``(C,)``."""
    return (y.is_cuda and times is None
            and all(x is None or (x.ndim if isinstance(x, torch.Tensor) else np.ndim(x)) <= 1 for x in values.values()))


def prepare_static(y_t: torch.Tensor, values: dict, checks: Checks, numpy_out: bool, out_dtype: object,
                   plan: dict | None = None) -> tuple[Problem, dict]:
    """``(problem, facts)`` for :func:`static_on_device` inputs (``values`` as there; the problem
    takes ``plan``'s fields): the problem's fields are ``(1, C)`` rows of one block; the verdicts
    are queued on ``checks`` (bad values raise when it is decided), the facts ``diffuse`` and
    ``no_noise`` returned as :class:`Flag` entries of the launch's flags (read with the verdicts,
    in one copy).

    The host's values are checked, converted and moved to the device once for a layout, their
    values and the current stream (:mod:`kalmanscan.problem.remembered`: not under ``torch.compile``
    nor while a CUDA graph is captured); a call repeating them stacks the kept device rows with its
    tensors (a new block: nothing returned shares them)."""
    from kalmanscan.kernels.filter.params import NFLAGS, param_rows_kernel  # (triton: only where it runs)

    dtype, device = y_t.dtype, y_t.device
    given = {k: values[k] for k in _ROWS if values[k] is not None}
    tensors = {k: x for k, x in given.items() if not on_host(x)}
    capturing = y_t.is_cuda and torch.cuda.is_current_stream_capturing()  # (a captured copy is not made now)
    key = None if torch.compiler.is_compiling() or capturing else _key(y_t, given, tensors)
    shape, host_rows = _DEVICE_ROWS.get(key, lambda: _host_part(y_t, given, tensors))
    C = shape[-1]
    rows = dict(host_rows)
    for k, x in tensors.items():
        x = to_device(x, device).to(dtype)
        rows[k] = x if x.shape == (C,) else x.expand(C)
    block = torch.stack([rows[k] for k in _ROWS])
    derived = torch.empty(5, C, dtype=dtype, device=device)
    flags = torch.empty(NFLAGS, dtype=torch.bool, device=device)  # read as they are (no cast)
    param_rows_kernel[(1,)](block.detach(), derived, flags, C, mobius.noise_bound(dtype), **_codes(),
                            GIVEN_MEAN="init_mean" in given, GIVEN_VAR="init_var" in given, BLOCK=_BLOCK,
                            num_warps=_WARPS)
    for message, i in _verdicts(dtype):
        checks.require(message, Flag(flags, i))
    row = block.view(len(_ROWS), 1, C).unbind(0)
    fields = dict(zip(PARAMS, row))
    init_var, decay, noise, lam0, eta0 = derived.view(5, 1, C).unbind(0)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in tensors.values())
    init_mean = row[6] if "init_mean" in given else fields["mean"]
    if "init_var" in given:
        init_var = row[7]
    elif grad:
        init_var = ou.stationary_var(fields["theta"], fields["sigma"])
    p = Problem(y=y_t, shape=shape, numpy_out=numpy_out, out_dtype=out_dtype, init_mean=init_mean,
                init_var=init_var, **fields, **(plan or {}))
    if not grad:
        p.derived = dict(decay=decay, noise=noise, lam0=lam0, eta0=eta0,
                         **{"from": {k: getattr(p, k) for k in _ROWS}})
    return p, dict(diffuse=Flag(flags, 10), no_noise=Flag(flags, 11))


_DEVICE_ROWS = Remembered(64)
"""``(shape, rows)`` of :func:`_host_part` by :func:`_key`."""


def _key(y_t: torch.Tensor, given: dict, tensors: dict) -> tuple | None:
    """What :func:`_host_part` computes from: ``y``'s shape, dtype and device, each tensor's shape
    (its values are read on the device, not here), each host value's exact contents
    (:func:`~kalmanscan.problem.remembered.value_key`); ``None`` when one is not keyed. On a GPU
    also the current stream: the kept rows are read only in the order of the stream their copy
    was queued on (no wait between streams, no reuse of their memory while another reads it)."""
    values = [("tensor", tuple(given[k].shape)) if k in tensors else value_key(given.get(k)) for k in _ROWS]
    if None in values:
        return None
    stream = torch.cuda.current_stream(y_t.device).cuda_stream if y_t.is_cuda else 0
    return (tuple(y_t.shape), y_t.dtype, y_t.device, stream, *values)


def _host_part(y_t: torch.Tensor, given: dict, tensors: dict) -> tuple[tuple, dict]:
    """``(shape, rows)``: the shape everything broadcasts to (``ValueError`` naming a parameter
    that does not broadcast) and the rows of the values given on the host (zeros for an initial
    belief not given) as ``(C,)`` views of one device tensor, moved in one copy; checked for
    overflow of the compute dtype (their bounds are the kernel's)."""
    dtype, shape = y_t.dtype, tuple(y_t.shape)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    host = {k: host_array(k, x, np_dtype) for k, x in given.items() if k not in tensors}
    for k, x in given.items():
        pshape = tuple(x.shape) if k in tensors else host[k].shape
        pshape = (1,) * (2 - len(pshape)) + pshape
        shape = broadcast_param(k, shape, pshape, shape[-2]) if k in PARAMS else broadcast_init(k, shape, pshape)
    C = shape[-1]
    names = [k for k in _ROWS if k not in tensors]  # the host's values, zeros where not given
    if not names:
        return shape, {}
    block = np.zeros((len(names), C), np_dtype)
    for i, k in enumerate(names):
        if k in host:
            block[i] = host[k]
    moved = to_device(torch.from_numpy(block), y_t.device)
    return shape, dict(zip(names, moved.unbind(0)))


@functools.cache
def _codes() -> dict:
    """The bounds as the rows kernel's constants (:func:`~kalmanscan.problem.bounds.kernel_codes`)."""
    return dict(zip(("B_THETA", "B_SIGMA", "B_OBS", "B_MEAN", "B_H", "B_DT"), kernel_codes()))


@functools.cache
def _verdicts(dtype: torch.dtype) -> tuple[tuple[str, int], ...]:
    """Each check's message and its entry of the kernel's flags, in the order and words of the
    torch path of :func:`kalmanscan.problem.prepare.prepare`."""
    bounds = tuple((f"{name} must be {requirement(BOUNDS[name])}", i) for i, name in enumerate(PARAMS))
    return bounds + ((NEEDS_INIT_VAR_THETA, 8), (NEEDS_INIT_VAR_SIGMA, 9),
                     (overflow_message(STATIONARY_OVERFLOW, dtype), 12),
                     ("init_var must be > 0 (or inf: a diffuse prior)", 7), ("init_mean must be finite", 6),
                     (overflow_message(NOISE_OVERFLOW, dtype), 13))
