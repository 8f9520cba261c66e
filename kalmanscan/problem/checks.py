"""Value checks that cost at most one device synchronisation (shared by the filter's entry points).

:class:`Checks` queues checks and facts on tensors and decides them together, at once or, through
:class:`Pending`, once a call's kernels are queued; :func:`check_no_inf`
searches ``y`` for ``inf``; :func:`queue_y_check` queues that search's cheap precursor (one
reduction); :func:`finite_sum` and :func:`check_y_by_result` are the by-result check (one reduction
of a result read back); :class:`Ahead` reads values queued before a call's kernels without waiting
for the kernels; :func:`queue_y_sum` and :func:`decide_y` are ``y``'s check for calls whose
parameters were checked on the host, decided once the kernels are queued.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from kalmanscan import tuning
from kalmanscan.types import ArrayLike

__all__ = ["Checks", "Pending", "Flag", "check_no_inf", "queue_y_check", "finite_sum", "check_y_by_result", "Ahead",
           "queue_y_sum", "decide_y", "queued_with_kernels", "NOT_FINITE"]


class Flag(NamedTuple):
    """Entry ``index`` of a vector of verdicts or facts (0/1 or boolean) that one launch wrote: a
    check or fact queued without a tensor of its own (:meth:`Checks.require`, :meth:`Checks.fact`);
    every entry of one vector comes back in one piece of the copy."""

    vector: torch.Tensor
    index: int


class Checks:
    """Value checks and facts on tensors, decided together with at most one synchronisation.

    ``add`` queues ``all(cond(x))`` without waiting for the device; ``fact`` queues a boolean
    tensor to be read back; ``decide`` reads every verdict and fact at once (those computed on the
    CPU cost no synchronisation; all those on a device come back in one copy) and raises
    ``ValueError`` for the first check that failed, in the order they were added. A verdict or fact
    may be a :class:`Flag` (an entry of a vector of them), read with its vector's other entries.
    """

    def __init__(self):
        self.items = []
        self.facts = {}

    def add(self, name: str, x: torch.Tensor, cond: Callable[[torch.Tensor], torch.Tensor], what: str) -> None:
        """Queue ``all(cond(x))`` (NaN fails), reported as ``"{name} must be {what}"``."""
        with torch.no_grad():
            self.items.append((f"{name} must be {what}", torch.all(cond(x.detach())), None))

    def require(self, message: str, ok: torch.Tensor | Flag, confirm: Callable[[], None] | None = None) -> None:
        """Queue a check given as a boolean tensor (or :class:`Flag`) ``ok`` and its full error
        message; when ``ok`` is false and ``confirm`` is given, ``confirm()`` decides instead (it
        raises or returns)."""
        self.items.append((message, ok, confirm))

    def fact(self, name: str, value: torch.Tensor | Flag | bool) -> None:
        """Queue a boolean tensor (or :class:`Flag`, or a Python bool) read back by :meth:`decide`
        as ``name``."""
        self.facts[name] = value

    def decide(self) -> dict:
        """Raise for the first failed check; return the facts as Python bools."""
        return self.queue().decide()

    def queue(self) -> Pending:
        """The verdicts and facts copied back without waiting (:class:`Ahead`, one vector per
        device: each tensor or :class:`Flag` vector once, concatenated), decided later by
        :meth:`Pending.decide`; the queue is emptied."""
        entries = [ok for _, ok, _ in self.items] + list(self.facts.values())
        known = [None] * len(entries)
        devices = {}  # device -> (vectors, their starts, (entry, element) read)
        for i, x in enumerate(entries):
            if isinstance(x, Flag):
                vector, at = x
            elif isinstance(x, torch.Tensor):
                vector, at = x, 0
            else:
                known[i] = bool(x)
                continue
            vectors, starts, where = devices.setdefault(vector.device, ([], [], []))
            # each vector once, whatever of it is read (found by identity, not id(): under
            # torch.compile an id() is a guard that a new tensor fails on every call)
            for v, start in zip(vectors, starts):
                if v is vector:
                    break
            else:
                start = starts[-1] + vectors[-1].numel() if vectors else 0
                vectors.append(vector)
                starts.append(start)
            where.append((i, start + at))
        reads = []
        for vectors, _, where in devices.values():
            flat = [v.reshape(-1).to(torch.bool) for v in vectors]
            reads.append((where, Ahead(flat[0] if len(flat) == 1 else torch.cat(flat))))
        pending = Pending([(message, confirm) for message, _, confirm in self.items], list(self.facts), known, reads)
        self.items, self.facts = [], {}
        return pending


class Pending:
    """Checks and facts queued by :meth:`Checks.queue`: :meth:`decide` reads them (one wait per
    device, for them alone, not for what was queued after them), raises ``ValueError`` for the first
    check that failed, in the order they were added, and returns the facts as Python bools."""

    def __init__(self, items: list, names: list, known: list, reads: list):
        self.items, self.names, self.known, self.reads = items, names, known, reads

    def decide(self) -> dict:
        verdict = list(self.known)
        for where, ahead in self.reads:
            values = ahead.read().cpu().numpy()
            for i, at in where:
                verdict[i] = bool(values[at])
        for (message, confirm), good in zip(self.items, verdict):
            if not good and confirm is None:
                raise ValueError(message)
            if not good:
                confirm()
        return dict(zip(self.names, verdict[len(self.items):]))


_Y_MESSAGE = "y must be finite or NaN (missing); it contains inf"


def check_no_inf(y: ArrayLike) -> None:
    """Raise ``ValueError`` if ``y`` holds ``inf`` (NaN is allowed: it marks a missing value). A
    NumPy array is searched in NumPy (it may be read-only, which torch would warn of)."""
    found = np.isinf(y).any() if isinstance(y, np.ndarray) else torch.isinf(torch.as_tensor(y)).any()
    if bool(found):
        raise ValueError(_Y_MESSAGE)


def queue_y_check(checks: Checks, y: torch.Tensor) -> None:
    """Queue the check that ``y`` holds no ``inf`` as one reduction with no temporary the size of
    ``y``: ``nansum(y)`` is finite unless ``y`` holds an ``inf`` or the sum overflows, and only
    then is ``y`` searched (:func:`check_no_inf`)."""
    checks.require(_Y_MESSAGE, _sum_is_finite(y), confirm=lambda: check_no_inf(y))


def _sum_is_finite(y: torch.Tensor) -> torch.Tensor:
    """``isfinite(nansum(y))`` as a 0-d bool tensor on ``y``'s device (one reduction, no gradient):
    false when ``y`` holds an ``inf`` (or the sum overflows). Written ``|s| < inf`` (false for NaN
    too): two launches where ``torch.isfinite`` dispatches four."""
    return _nansum(y).abs() < math.inf


def _nansum(y: torch.Tensor) -> torch.Tensor:
    """``nansum(y)`` as a 0-d tensor on ``y``'s device, without gradient."""
    with torch.no_grad():
        return torch.nansum(y.detach())


def finite_sum(x: torch.Tensor) -> bool:
    """Whether the sum of ``x`` is finite: false when an element is not (or the sum overflows). One
    reduction read back: one synchronisation on a device."""
    return math.isfinite(float(x.detach().sum()))


NOT_FINITE = ("the filter's result is not finite though y and the parameters are: a log-likelihood of -inf "
              "(an observation so far from its prediction that its squared standardised distance passes {dtype}'s "
              "largest value, {limit:.4g}); express y, sigma and obs_var in a larger unit, or check obs_var and "
              "mean")
"""The error for a non-finite result from finite inputs (:func:`check_y_by_result`)."""


def check_y_by_result(y: torch.Tensor, witness: torch.Tensor) -> None:
    """``y``'s inf check from a result it reaches: an ``inf`` in ``y`` makes ``witness`` (the
    log-likelihood summed over time, or the last filtered mean; with a diffuse prior plus the
    finite problem's initial mean, which a diffuse channel's first observation sets) non-finite,
    so ``y`` is searched only when ``witness`` is not finite. One read of ``witness``: the call's
    one synchronisation, made last so that the device works while the host assembles the result.
    A ``witness`` that is not finite though ``y`` holds no ``inf`` (the log-likelihood ``-inf`` of
    an observation too far out for the dtype) is an error too (:data:`NOT_FINITE`)."""
    if not finite_sum(witness):
        check_no_inf(y)
        raise ValueError(NOT_FINITE.format(dtype=str(y.dtype).removeprefix("torch."),
                                           limit=float(torch.finfo(y.dtype).max)))


class Ahead:
    """Values computed on the device before a call's kernels are queued, copied back to the host
    without waiting (page-locked memory, an event after the copy), and read once the kernels are
    queued: :meth:`read` waits for the values and what was queued before them, not for the kernels,
    so the call returns while its kernels run and calls queue behind each other. On a CPU, under
    ``torch.compile`` and while a CUDA graph is captured, :meth:`read` returns the values as they are.
    """

    def __init__(self, values: torch.Tensor):
        self.values, self.event = values, None
        if values.is_cuda and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing():
            self.values = values.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> torch.Tensor:
        """The values (on the host for a device's): one wait on the device, for them alone."""
        if self.event is not None:
            self.event.synchronize()
        return self.values


def queued_with_kernels(y: torch.Tensor) -> bool:
    """Whether the triton backend queues ``y``'s inf check with its kernels (``Problem.y_check``):
    a ``y`` of more than :attr:`kalmanscan.tuning.Tuning.y_by_result` elements, outside
    ``torch.compile``; a smaller one is checked from the call's result."""
    return y.numel() > tuning.current().y_by_result and not torch.compiler.is_compiling()


def queue_y_sum(y: torch.Tensor) -> Ahead:
    """``nansum(y)`` queued before a call's kernels and read through :class:`Ahead` (finite exactly
    when ``y`` holds no ``inf``, unless the sum overflows): ``y``'s check for a ``y`` of more than
    :attr:`kalmanscan.tuning.Tuning.y_by_result` elements whose kernels do not take it from their own pass."""
    return Ahead(_nansum(y))


def decide_y(y: torch.Tensor, queued: Ahead | None, witness: torch.Tensor | None = None) -> None:
    """``y``'s inf check for a call whose parameters were checked on the host, decided once its
    kernels are queued: ``ValueError`` naming ``y`` if it holds an ``inf``; one synchronisation.

    From ``queued`` when given (an :class:`Ahead` of a value finite exactly when ``y`` holds no
    ``inf``, queued before or among the kernels: :func:`queue_y_sum`, or the filter's own pass over
    ``y``): the wait is for it, not for the kernels. Else from a result ``y`` reaches
    (:func:`check_y_by_result`, no pass over ``y``), else by a reduction of ``y`` now. ``y`` is
    searched only when the value read is not finite."""
    if queued is None and witness is not None:
        check_y_by_result(y, witness)
        return
    finite = math.isfinite(float(queued.read())) if queued is not None else bool(_sum_is_finite(y))
    if not finite:
        check_no_inf(y)
