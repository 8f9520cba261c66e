"""Inputs and checks shared by the KLA scan's tests (``tests/ops/kla``)."""

from __future__ import annotations

import contextlib

import torch


def make_inputs(B, L, M, S, seed=0, with_state=False, dtype=torch.float64, device="cpu"):
    """Random non-degenerate inputs (unit-norm k and q, decay in (0.6, 1), noise in (0.05, 1)),
    made on the CPU (the same values on every device) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [
        randn(B, L, M),
        0.1 + 2.0 * rand(B, L, M),
        torch.nn.functional.normalize(randn(B, L, S), dim=-1),
        torch.nn.functional.normalize(randn(B, L, S), dim=-1),
        0.6 + 0.4 * rand(M, S),
        0.05 + 0.95 * rand(M, S),
    ]
    if with_state:
        xs += [0.5 + rand(B, M, S), randn(B, M, S)]
    return [x.to(dtype=dtype, device=device) for x in xs]


def outputs_and_grads(fn, xs, seed=1):
    """Outputs of ``fn`` and the gradients of a random linear functional of all four of them."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    outs = fn(xs)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
               for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [x.grad for x in xs]


@contextlib.contextmanager
def poisoned():
    """Every buffer torch.empty and torch.empty_like allocate starts as NaN (torch's deterministic
    mode with ``fill_uninitialized_memory``): an element a kernel leaves unwritten shows."""
    assert torch.utils.deterministic.fill_uninitialized_memory
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
