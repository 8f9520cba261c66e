"""The host work of a KLA scan call: the torch operations it dispatches (the fused kernels replaced by
no-ops, so only the Python and torch work around them counts), and that a call without gradients,
which skips the operator's dispatch, gives the operator's results."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import KERNEL_DEVICE
from kla_helpers import make_inputs
from kalmanscan.ops.kla import kla_scan
from kalmanscan.ops.kla.triton import library
from kalmanscan.ops.kla.triton.backend import kla_scan_triton



class Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_operations_per_call(monkeypatch):
    """Without gradients: the kernels' wrapper allocates its outputs and nothing else (6
    allocations, no fill, no copy); the checked call adds one extremum per checked tensor and
    their stack (on a GPU also their copy back to the host)."""
    for name in ("kla_fwd_kernel", "kla_piece_map_kernel"):
        monkeypatch.setattr(library, name, NoLaunch())
    xs = [x.float() for x in make_inputs(2, 16, 8, 4, device=KERNEL_DEVICE)]
    copies = int(xs[0].is_cuda)
    with torch.no_grad():
        for call, budget in ((lambda: kla_scan_triton(*xs), 6), (lambda: kla_scan(*xs, backend="triton"), 10)):
            call()
            with Dispatched() as d:
                call()
            assert sum(d.ops.values()) <= budget + (copies if budget > 6 else 0), dict(d.ops)
            assert not any("fill" in op or "zero" in op for op in d.ops), dict(d.ops)
            assert sum(n for op, n in d.ops.items() if "copy" in op) <= (copies if budget > 6 else 0), dict(d.ops)


@pytest.mark.parametrize("config", [library.DEFAULT_CONFIG, library.SPLIT_CONFIG])
def test_wrapper_copies_nothing_in_either_layout(monkeypatch, config):
    """With the grid turned (``states_first``, the launch of few channel blocks) as without: the
    kernels read ``decay`` and ``noise`` in their own layout and the final state comes back as a
    view of theirs, so a call without gradients makes no copy of either, forward and backward
    alike (the backward: its allocations and the k, q, decay and noise partial sums)."""
    for name in ("kla_fwd_kernel", "kla_piece_map_kernel", "kla_bwd_kernel", "kla_adjoint_map_kernel"):
        monkeypatch.setattr(library, name, NoLaunch())
    xs = [x.float() for x in make_inputs(2, 16, 8, 4, device=KERNEL_DEVICE)]
    with torch.no_grad(), Dispatched() as d:
        kla_scan_triton(*xs, config=config)
    assert not any("copy" in op or "clone" in op for op in d.ops), dict(d.ops)
    ints = config.as_ints()
    _, _, lam, eta, ckpt_lam, ckpt_eta = library.kla_scan_fwd(*xs[:6], None, None, True, ints)
    grads = [torch.ones_like(x) for x in (xs[0], xs[0], lam, eta)]
    with Dispatched() as d:
        library.kla_scan_bwd(*xs[:6], ckpt_lam, ckpt_eta, *grads, ints)
    assert not any("copy" in op or "clone" in op for op in d.ops), dict(d.ops)


def test_call_without_gradients_equals_the_operator():
    """The wrapper's direct call and the operator: the same launches, bit for bit the same results."""
    xs = [x.float() for x in make_inputs(2, 37, 5, 3, seed=2, with_state=True, device=KERNEL_DEVICE)]
    config = library.launch_config(2, 37, 5, xs[0].device).as_ints()
    with torch.no_grad():
        direct = kla_scan_triton(*xs)
        operator = library.kla_scan_fwd(*xs, False, config)[:4]
    for a, b in zip(direct, operator):
        assert torch.equal(a, b)
