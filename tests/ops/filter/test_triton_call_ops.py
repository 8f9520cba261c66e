"""Every torch operation and kernel launch of a default ``ks.filter(..., backend="triton")`` call,
pinned (kernels under ``TRITON_INTERPRET=1`` on the CPU).

The default call's device work is its three walking kernels (aggregate, carry, output walk) and
a handful of small operations: the log-likelihood's per-stretch sums added and cast, ``y``'s inf
check and the read of its verdict; with parameters given as device tensors, the rows block stacked,
the parameter-rows kernel and its verdicts joined for one read. Nothing the size of ``y`` but the
kernels and ``y``'s one reduction (a large ``y``'s check comes from the aggregate pass instead,
whether the parameters are host values or device tensors).
The operations that launch device work are listed exactly, so none is added unnoticed; views and
empty allocations (no launch) are bounded in number.
"""

import collections
import os

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

import kalmanscan as ks
from kalmanscan import tuning
from kalmanscan.ops.filter.triton import backend as triton_backend
from kalmanscan.problem import prepare as prepare_module

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts the interpreter's launches (on a GPU: tests/test_call_cost.py)")

FREE = {"aten.empty.memory_format", "aten.view.default", "aten.expand.default", "aten.unbind.int",
        "aten.as_strided.default", "aten.detach.default", "aten.lift_fresh.default", "aten.alias.default",
        "aten.slice.Tensor", "aten.select.int", "aten._unsafe_view.default"}
"""Operations that launch nothing on a device: views, detaching, empty allocations."""


class _Ops(TorchDispatchMode):
    """The operations dispatched outside kernel launches, in order, and the launches by kernel name."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.inside = [], [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def work(self) -> collections.Counter:
        """The operations that launch device work (or read a value back), counted by name."""
        return collections.Counter(op for op in self.ops if op not in FREE)

    def counting(self, launch):
        """The interpreter's ``launch`` recording its kernel's name; the operations the interpreter
        runs inside it are not the call's."""
        def counted(executor, *args, **kwargs):
            self.launches.append(executor.fn.__name__)
            outer, self.inside = self.inside, True
            out = launch(executor, *args, **kwargs)
            self.inside = outer
            return out
        return counted


@pytest.fixture
def ops(monkeypatch):
    mode = _Ops()
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", mode.counting(interpreter.GridExecutor.__call__))
    return mode


WALKS = ["filter_agg_kernel", "filter_carry_kernel", "filter_fwd_kernel"]
LOGLIK = {"aten.sum.dim_IntList": 1, "aten._to_copy.default": 1}  # the stretches' sums added, cast to y's dtype
BY_RESULT = {"aten.sum.default": 1, "aten._local_scalar_dense.default": 1}  # y's check read from the result
FROM_AGG = {"aten.sum.default": 1, "aten._local_scalar_dense.default": 1}  # ...from the aggregate pass
DEVICE_ROWS = {"aten.nansum.default": 1, "aten.abs.default": 1, "aten.lt.Scalar": 1,  # y's one reduction, finite
               "aten.stack.default": 1, "aten.cat.default": 1,  # the rows block; the verdicts joined
               "aten._to_copy.default": 1}  # (a CPU theta is read as a host value: on a GPU, no copy)
ROWS_ONLY = {k: n for k, n in DEVICE_ROWS.items() if k not in ("aten.nansum.default", "aten.abs.default",
                                                                "aten.lt.Scalar", "aten.cat.default")}
# (a large y's check from the pass: the verdicts are the kernel's one vector, read without a cat)


def _add(*parts: dict) -> collections.Counter:
    total = collections.Counter()
    for part in parts:
        total.update(part)
    return total


CASES = {  # (y above the by-result limit, parameters as device tensors) -> launches, device work, most free ops
    "host": (False, False, WALKS, _add(LOGLIK, BY_RESULT), 19),
    "host-large-y": (True, False, WALKS, _add(LOGLIK, FROM_AGG), 19),
    "device": (False, True, ["param_rows_kernel"] + WALKS, _add(DEVICE_ROWS, LOGLIK, BY_RESULT), 30),
    "device-large-y": (True, True, ["param_rows_kernel"] + WALKS, _add(ROWS_ONLY, LOGLIK, FROM_AGG), 30),
}


@pytest.mark.parametrize("case", list(CASES))
def test_default_call_dispatches_exactly_these(monkeypatch, ops, case):
    """The default call (T = 200, C = 64: three stretches) on host parameters, on a ``y`` whose
    check comes from the aggregate pass (a ``y`` over the by-result limit whose call is not replayed
    from a CUDA graph: a large one on a GPU), and with ``theta`` a ``(C,)`` device tensor (the
    parameter-rows path; its GPU gate lifted for the interpreter)."""
    large, device, launches, work, free = CASES[case]
    T, C = 200, 64
    y = torch.randn(T, C, generator=torch.Generator().manual_seed(0))
    y[::7, 1] = float("nan")
    kw = dict(theta=0.3, sigma=0.7, obs_var=0.4)
    if device:
        monkeypatch.setattr(prepare_module, "host_parameters", lambda *args: False)
        monkeypatch.setattr(prepare_module, "static_on_device", lambda y, values, times: times is None and all(
            np.ndim(x) <= 1 for x in values.values() if x is not None))
        kw["theta"] = torch.rand(C, generator=torch.Generator().manual_seed(1)) + 0.05
    if large:
        monkeypatch.setattr(triton_backend, "replayed", lambda *args: False)
    want = ks.filter(y, backend="torch", **kw)
    with tuning.tuned(y_by_result=T * C - 1 if large else T * C):
        ks.filter(y, backend="triton", **kw)  # first call: compiles, remembers the host rows
        ops.launches.clear()
        with ops:
            post = ks.filter(y, backend="triton", **kw)
    assert ops.launches == launches
    assert ops.work() == work, ops.work()
    assert len(ops.ops) - sum(ops.work().values()) <= free, ops.ops
    for name in ("mean", "var", "loglik"):
        torch.testing.assert_close(getattr(post, name), getattr(want, name), rtol=1e-5, atol=1e-5)
