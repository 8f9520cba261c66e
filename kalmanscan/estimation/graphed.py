"""An objective's evaluation replayed from a CUDA graph: what :func:`kalmanscan.fit` runs per
L-BFGS evaluation on a GPU, where launching the forward and backward's operations one by one
from Python costs several times the kernels' own time.

:class:`GraphedEvaluation` captures once (after warm-up evaluations on a side stream, as CUDA
graphs require): copy ``x`` from a pinned host buffer into the parameters, evaluate the
objective, its gradient by autograd, and copy both into a pinned host buffer. A call writes
``x``, replays, waits for the stream and reads: one launch and one synchronisation. Shapes,
devices and every Python-side decision of the objective are those of the capture, so the
objective must make no data-dependent host decision (:class:`kalmanscan.estimation.likelihood.Likelihood`
with ``graphed=True`` folds its one such decision, whether some filter lacks process noise, into
a NaN value). A value that comes back non-finite is evaluated again eagerly (``eager``), so every
value the optimiser sees outside the graph's domain is the eager one's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["GraphedEvaluation"]

WARMUP = 3
"""Eager evaluations on a side stream before the capture (CUDA graphs' documented warm-up)."""


class GraphedEvaluation:
    """``fun(x) -> (f, gradient)`` (float64 NumPy, ``x`` the parameters flattened in order) of
    ``objective()`` over the CUDA tensors ``params`` (leaves that require grad), replayed from
    one CUDA graph; ``eager(x)`` answers wherever the replay's value is not finite. Capturing
    evaluates at the parameters' current values and leaves them there."""

    def __init__(self, objective: Callable[[], torch.Tensor], params: list[torch.Tensor],
                 eager: Callable[[np.ndarray], tuple[float, np.ndarray]]):
        device, dtype = params[0].device, params[0].dtype
        sizes = [p.numel() for p in params]
        self.eager = eager
        self.x_host = torch.cat([p.detach().reshape(-1) for p in params]).cpu().pin_memory()
        self.out_host = torch.empty(1 + sum(sizes), dtype=torch.float64).pin_memory()
        x_dev = torch.empty(sum(sizes), dtype=dtype, device=device)

        def evaluate():
            x_dev.copy_(self.x_host, non_blocking=True)
            with torch.no_grad():
                for p, chunk in zip(params, torch.split(x_dev, sizes)):
                    p.copy_(chunk.view(p.shape))
            loss = objective()
            grads = torch.autograd.grad(loss, params)
            back = torch.cat([loss.detach().reshape(1)] + [g.reshape(-1) for g in grads])
            self.out_host.copy_(back.to(torch.float64), non_blocking=True)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                evaluate()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            evaluate()
        self.stream = torch.cuda.current_stream(device)

    def __call__(self, x: np.ndarray) -> tuple[float, np.ndarray]:
        self.x_host.copy_(torch.from_numpy(np.asarray(x, dtype=np.float64)))
        self.graph.replay()
        self.stream.synchronize()
        out = self.out_host.numpy().copy()
        if not np.all(np.isfinite(out)):
            return self.eager(x)
        return float(out[0]), out[1:]
