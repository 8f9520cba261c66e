"""The KLA scan's registry of backends, its input validation and its dispatch: :func:`kla_scan`
for any caller (inputs checked, one device-to-host synchronisation, which on a GPU does not wait
for the kernels), :func:`kla_scan_unchecked` for
callers whose inputs are valid by construction (shapes checked on the host, no synchronisation);
the operation is described in :mod:`kalmanscan.ops.kla`."""

from __future__ import annotations

import contextlib
import math
import os
from types import ModuleType
from typing import NamedTuple


import torch

from kalmanscan.model import mobius
from kalmanscan.problem.checks import Ahead
from kalmanscan.ops.registry import Registry
from kalmanscan.ops.kla.documents import check_cu_seqlens, cu_seqlens_ok, queue_cu_seqlens
from kalmanscan.ops.kla.state import FilterState

__all__ = ["kla_scan", "kla_scan_unchecked", "register_backend", "unregister_backend", "backend_names", "validate",
           "queue_checks", "decide_checks", "check_shapes", "Pending", "NOISE_FLOOR"]

# Process noise added on the fused kernels' path of kla_scan_unchecked: it bounds their float32
# precision by 1/NOISE_FLOOR + max(lam_v k^2). Measured (interpreter, decay 0.3-0.4, L 60): noise
# 1e-18 gives every gradient to 1.3e-7 of the float64 recursion; at 1e-24 the noise gradient
# (which grows like lam^2) overflows. 1e-15 leaves a factor 1e6 of margin on that square and is
# below float32's rounding of any noise above 1e-8.
NOISE_FLOOR = 1e-15

_REGISTRY = Registry({"reference": "kalmanscan.ops.kla.reference", "torch": "kalmanscan.ops.kla.torch",
                      "recurrent": "kalmanscan.ops.kla.recurrent", "triton": "kalmanscan.ops.kla.triton.backend",
                      "cpu": "kalmanscan.ops.kla.cpu.backend"})
# torch.compile traces a call whole only through modules already imported (an import breaks its
# graph): the backends "auto" can pick on this machine are imported with the dispatch.
for _name in ("torch", "cpu", "triton") if torch.cuda.is_available() else ("torch", "cpu"):
    _REGISTRY.module(_name)


def register_backend(name: str, module: ModuleType) -> None:
    """Make ``kla_scan(..., backend=name)`` call ``module.kla_scan(v, lam_v, k, q, decay, noise,
    initial_state) -> (y, y_var, state)`` (a module, or its import path imported on first use; a
    call with ``cu_seqlens`` passes it as a keyword)."""
    _REGISTRY.register(name, module)


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend` (the built-in ones stay)."""
    _REGISTRY.unregister(name)


def backend_names() -> tuple[str, ...]:
    """The names ``backend`` accepts: ``"auto"`` and every registered backend."""
    return _REGISTRY.names()


def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor, *,
             initial_state: FilterState | None = None, return_state: bool = False,
             backend: str = "auto", cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Run the KLA filters over the sequence (see the module docstring for shapes and numerics).

    Returns ``(y, y_var)``, or ``(y, y_var, state)`` with the final :class:`FilterState` (it
    unpacks as ``(lam, eta)``) when ``return_state`` is true. ``initial_state`` is a pair
    ``(lam, eta)`` of ``(B, M, S)`` tensors with ``lam > 0``, or a :class:`FilterState` (continued
    from its ``var`` and ``mu``). ``backend`` is ``"torch"`` (the time-parallel scan),
    ``"triton"``, ``"cpu"`` (compiled loops, :mod:`kalmanscan.ops.kla.cpu`), ``"recurrent"``
    (token by token in torch operations, :mod:`kalmanscan.ops.kla.recurrent`), ``"reference"`` or
    ``"auto"``: triton for CUDA tensors, cpu for CPU tensors, torch on other devices.
    Filters with ``decay < 1`` and no process noise (``noise``
    below :data:`kalmanscan.model.mobius.NO_NOISE`), and initial states whose variance is below it, run
    on the torch backend when ``backend`` is triton: their precision is past the range of the fused
    kernels, which carry it, while the torch backend scans the variance and the mean.

    ``cu_seqlens`` (int32 ``(N + 1,)``, fla's convention, :mod:`kalmanscan.ops.kla.documents`):
    ``v`` holds ``N`` documents packed in one row ``(1, total, M)``; the filters restart at each
    document's first token, ``initial_state`` (optional) and the returned state have one row per
    document, ``(N, M, S)``. Raises ``ValueError`` naming the offending argument.
    """
    check_shapes(v, lam_v, k, q, decay, noise, initial_state, backend, cu_seqlens)
    args = (v, lam_v, k, q, decay, noise, initial_state, return_state, cu_seqlens)
    if not _launch_first(v) or _resolve(backend, v, False) != "triton":
        mean_form = decide_checks(queue_checks(lam_v, decay, noise, initial_state, cu_seqlens), noise.dtype)
        return _run(_resolve(backend, v, mean_form), *args)
    # On a GPU the checks are queued first, on a stream beside the kernels' (_beside), their
    # extrema copied back without waiting, then the fused kernels launched and the extrema read
    # (checks.Ahead): the read waits for the checks, not for the kernels, so the call returns while
    # its kernels run, and the kernels do not wait for the checks. The result is returned only
    # once the checks passed, and is replaced by the torch backend's when the filters turn out to
    # need the mean form.
    with _beside(v):
        pending = queue_checks(lam_v, decay, noise, initial_state, cu_seqlens)
        if pending is not None:
            pending = pending._replace(values=Ahead(pending.values))
    out = _run("triton", *args)
    if pending is not None:
        pending = pending._replace(values=pending.values.read())
    if decide_checks(pending, noise.dtype):
        return _run("torch", *args)
    return out


def kla_scan_unchecked(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor,
                       decay: torch.Tensor, noise: torch.Tensor, *,
                       initial_state: FilterState | None = None, return_state: bool = False,
                       backend: str = "auto", noise_free: bool = False,
                       variance: bool = True, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`kla_scan` for inputs valid by construction (a layer's): no value checks and no
    device-to-host synchronisation, in the forward or the backward; shapes, dtypes and devices
    are still checked on the host (:func:`check_shapes`), and ``torch.compile`` traces it whole.

    The caller guarantees ``lam_v > 0``, ``decay`` in ``(0, 1]``, ``noise >= 0``, all finite,
    ``cu_seqlens`` (if any) valid (:func:`kalmanscan.ops.kla.documents.validate_cu_seqlens`), and
    states what :func:`kla_scan` would read from the values: ``noise_free`` is true when some
    filter with ``decay < 1`` may have no process noise (``noise`` below
    :data:`kalmanscan.model.mobius.NO_NOISE`, e.g. a layer with ``sigma`` fixed at 0). Such filters run
    in mean form (the torch backend when ``backend`` resolves to triton), exact at every length.
    Otherwise the fused kernels take ``noise + NOISE_FLOOR`` (:data:`NOISE_FLOOR`), which keeps
    their float32 precision and its gradients in range whatever the noise learns; the other
    backends take ``noise`` as it is. An ``initial_state`` must come from a previous call with the
    same ``noise_free`` (its variance is then at least the floor, or it runs in mean form).
    ``variance=False``: ``y_var`` is ``None`` (the fused kernels then neither compute nor store it,
    nor read its gradient; the other backends drop it).
    """
    check_shapes(v, lam_v, k, q, decay, noise, initial_state, backend, cu_seqlens)
    backend = _resolve(backend, v, noise_free)
    if backend == "triton":
        noise = noise + NOISE_FLOOR
    return _run(backend, v, lam_v, k, q, decay, noise, initial_state, return_state, cu_seqlens, variance)


def _launch_first(v: torch.Tensor) -> bool:
    """Whether :func:`kla_scan` launches the fused kernels before reading its checks: on a GPU,
    where the device would otherwise idle during the read (not under the interpreter)."""
    return v.is_cuda


_CHECK_STREAMS: dict = {}


def _beside(v: torch.Tensor):
    """The context in which :func:`kla_scan` queues its value checks on a GPU: a high-priority
    stream of ``v``'s device, forked from the current stream (it waits for the inputs' producers),
    so that the checks (a pass over ``lam_v`` and the parameters) run beside the kernels instead
    of before them (queued ahead of them, the public forward took 1.11x its kernels' time at
    B = 8, L = 2048, M = 1024, S = 16 on an H100). The call reads the checks before it returns, so
    nothing it was given is still read on that stream afterwards. The current stream itself on a
    CPU, under ``torch.compile`` and while a CUDA graph is captured (where nothing is checked)."""
    if not v.is_cuda or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return contextlib.nullcontext()
    stream = _CHECK_STREAMS.get(v.device)
    if stream is None:
        stream = _CHECK_STREAMS[v.device] = torch.cuda.Stream(v.device, priority=-1)
    stream.wait_stream(torch.cuda.current_stream(v.device))
    return torch.cuda.stream(stream)


def _resolve(backend, v, mean_form):
    """The backend ``"auto"`` stands for, and torch for triton when the filters need the mean form."""
    if backend == "auto":
        backend = "triton" if v.is_cuda else "cpu" if v.device.type == "cpu" else "torch"
    return "torch" if backend == "triton" and mean_form else backend


def _run(backend, v, lam_v, k, q, decay, noise, initial_state, return_state, cu_seqlens, variance=True):
    module = _REGISTRY.module(backend)
    kwargs = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens)
    if not variance and backend == "triton":
        kwargs["variance"] = False
    y, y_var, state = module.kla_scan(v, lam_v, k, q, decay, noise, initial_state, **kwargs)
    if not variance:
        y_var = None
    if return_state and v.shape[1] == 0:  # the initial state: new tensors, not the caller's (or aliases)
        state = FilterState(*(x.clone() for x in (*state, state.var, state.mu)))
    if y.dtype != v.dtype:
        y, y_var = y.to(v.dtype), None if y_var is None else y_var.to(v.dtype)
    return (y, y_var, state) if return_state else (y, y_var)


def validate(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor, initial_state: FilterState | None, backend: str,
             cu_seqlens: torch.Tensor | None = None) -> bool:
    """Check shapes, dtypes, devices and value ranges; return whether the filters need the mean
    form of the torch backend (a precision past the fused kernels' range, see :func:`kla_scan`)."""
    check_shapes(v, lam_v, k, q, decay, noise, initial_state, backend, cu_seqlens)
    return decide_checks(queue_checks(lam_v, decay, noise, initial_state, cu_seqlens), noise.dtype)


def _positive(lo, hi):
    return lo > 0 and hi < math.inf


def _non_negative(lo, hi):
    return lo >= 0 and hi < math.inf


def _unit(lo, hi):
    return lo > 0 and hi <= 1


_LAM_V = ("lam_v", _positive, "positive and finite")
_DECAY = ("decay", _unit, "in (0, 1]")
_NOISE = ("noise", _non_negative, "finite and >= 0")
_VAR0 = ("initial_state var", _non_negative, "finite and >= 0")
_LAM0 = ("initial_state lam", _positive, "positive and finite")


class Pending(NamedTuple):
    """Value checks queued on the device (:func:`queue_checks`): ``ranges``, one ``(name, ok,
    what)`` per checked tensor; ``values``, their minima and maxima in turn (then, with
    ``cu_seqlens``, its first and last offsets and smallest step; the widest dtype: every value
    exact); the ``decay`` and ``noise`` tensors; the number of tokens ``total``."""

    ranges: list
    values: torch.Tensor
    decay: torch.Tensor
    noise: torch.Tensor
    total: int | None


def queue_checks(lam_v: torch.Tensor, decay: torch.Tensor, noise: torch.Tensor,
                 initial_state: FilterState | None, cu_seqlens: torch.Tensor | None = None) -> Pending | None:
    """The value checks of :func:`validate`, queued on the device without waiting: one ``aminmax``
    per tensor, stacked into one tensor (:class:`Pending`). ``None`` when there is nothing to check
    or a CUDA graph is being captured (no value can be read)."""
    ranges = [(r, x) for r, x in ((_LAM_V, lam_v), (_DECAY, decay), (_NOISE, noise)) if x.numel()]
    if initial_state is not None:
        x = initial_state.var if isinstance(initial_state, FilterState) else initial_state[0]
        if x.numel():
            ranges.append((_VAR0 if isinstance(initial_state, FilterState) else _LAM0, x))
    if (not ranges and cu_seqlens is None) or (lam_v.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    with torch.no_grad():  # NaN fails every comparison
        values = torch.stack([m for _, x in ranges for m in torch.aminmax(x)]) if ranges else None
        if cu_seqlens is not None:
            offsets = queue_cu_seqlens(cu_seqlens)
            values = offsets if values is None else torch.cat([values.to(torch.float64), offsets])
    return Pending([r for r, _ in ranges], values, decay, noise, None if cu_seqlens is None else lam_v.shape[1])


def decide_checks(pending: Pending | None, dtype: torch.dtype) -> bool:
    """Read :func:`queue_checks`' values (one device-to-host copy), raise ``ValueError`` naming the
    first argument out of its range, and return whether the filters need the mean form.

    That is whether the smallest process noise among filters with ``decay < 1`` (or the smallest
    initial variance) is below :func:`kalmanscan.model.mobius.noise_bound`: the smallest noise of all is
    a lower bound on it, so the decaying filters' own minimum is read (a second reduction and
    read) only when the smallest noise is below the bound."""
    if pending is None:
        return False
    values = pending.values.tolist()
    extrema = {}
    for i, (name, ok, what) in enumerate(pending.ranges):
        extrema[name] = values[2 * i], values[2 * i + 1]
        if not ok(*extrema[name]):
            raise ValueError(f"{name} must be {what}")
    if pending.total is not None:
        cu_seqlens_ok(*values[-3:], pending.total)
    bound = mobius.noise_bound(dtype)
    smallest = extrema["initial_state var"][0] if "initial_state var" in extrema else math.inf
    if "noise" in extrema and extrema["noise"][0] < bound:
        smallest = min(smallest, float(mobius.decaying_noise(pending.decay, pending.noise).amin()))
    return mobius.precision_overflows(smallest, dtype)


def check_shapes(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
                 noise: torch.Tensor, initial_state: FilterState | None, backend: str,
                 cu_seqlens: torch.Tensor | None = None) -> None:
    """The host-side part of :func:`validate`: the backend's name, and the arguments' types,
    floating dtypes, devices and shapes (no value is read: no synchronisation)."""
    if backend not in _REGISTRY.names():
        raise ValueError(f"backend must be one of {backend_names()}, got {backend!r}")
    for name, x in (("v", v), ("lam_v", lam_v), ("k", k), ("q", q), ("decay", decay), ("noise", noise)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point torch tensor")
        if x.device != v.device:
            raise ValueError(f"{name} is on {x.device}, v is on {v.device}")
    if v.ndim != 3:
        raise ValueError(f"v must have shape (B, L, M), got {tuple(v.shape)}")
    B, L, M = v.shape
    if lam_v.shape != v.shape:
        raise ValueError(f"lam_v must have v's shape {tuple(v.shape)}, got {tuple(lam_v.shape)}")
    if k.ndim != 3 or k.shape[:2] != (B, L):
        raise ValueError(f"k must have shape (B, L, S) = ({B}, {L}, S), got {tuple(k.shape)}")
    S = k.shape[2]
    if q.shape != k.shape:
        raise ValueError(f"q must have k's shape {tuple(k.shape)}, got {tuple(q.shape)}")
    for name, x in (("decay", decay), ("noise", noise)):
        if x.shape != (M, S):
            raise ValueError(f"{name} must have shape (M, S) = ({M}, {S}), got {tuple(x.shape)}")
    if backend == "triton" and not v.is_cuda and not _interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1)")
    if backend == "cpu" and v.device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, v is on {v.device}")
    rows = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, v)
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError(f"initial_state must be a pair (lam, eta) of ({rows}, M, S) tensors")
        for name, x in (("initial_state lam", initial_state[0]), ("initial_state eta", initial_state[1])):
            if not isinstance(x, torch.Tensor) or x.shape != (rows, M, S) or x.device != v.device:
                raise ValueError(f"{name} must be a ({rows}, {M}, {S}) tensor on {v.device}")


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
