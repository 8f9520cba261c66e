"""The optimisers of :func:`kalmanscan.fit`, on a dict ``u`` of unconstrained parameter tensors
(changed in place) and an ``objective(u) -> scalar tensor`` differentiable in them.

Both return ``(converged, iterations, message)`` and show a tqdm bar when ``progress`` is true,
which ends at 100% and says whether the fit converged when it stops before ``max_iter``. An
``objective`` that is not finite, or raises ``ValueError`` (a step so long that a parameter under-
or overflowed), is treated as an infinite objective. L-BFGS reads each evaluation's objective
and gradient back from the device in one transfer (the only synchronisation it needs);
:func:`lbfgs_numpy` is the same driver for an objective that is a NumPy function already.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import torch

from kalmanscan.estimation.graphed import GraphedEvaluation

__all__ = ["lbfgs", "lbfgs_numpy", "adam"]

Objective = Callable[[dict], torch.Tensor]


def lbfgs(objective: Objective, u: dict[str, torch.Tensor], max_iter: int, tol: float,
          progress: bool, captured: Callable[[], torch.Tensor] | None = None) -> tuple[bool, int, str]:
    """``scipy.optimize.minimize(method="L-BFGS-B")`` on the flattened coordinates, torch gradients
    (:func:`lbfgs_numpy` on them; ``u`` holds its result).

    ``captured``: the objective at ``u`` written for a CUDA graph (no host decision on values;
    non-finite where the eager ``objective`` must decide): evaluations replay it from one graph
    (:class:`kalmanscan.estimation.graphed.GraphedEvaluation`), the eager ``objective`` answering where its
    value is not finite."""
    params = list(u.values())
    sizes = [p.numel() for p in params]

    def fun(x):
        flat = torch.as_tensor(x, dtype=params[0].dtype).to(params[0].device, non_blocking=True)
        with torch.no_grad():
            for p, chunk in zip(params, torch.split(flat, sizes)):
                p.copy_(chunk.reshape(p.shape))
        for p in params:
            p.grad = None
        try:
            loss = objective(u)
        except ValueError:  # a step so long that a parameter under- or overflowed: rejected like inf
            return math.inf, np.zeros(sum(sizes))
        loss.backward()
        # the objective and its gradient come back to the host together: one transfer per evaluation
        back = torch.cat([loss.detach().reshape(1)] + [p.grad.reshape(-1) for p in params]).cpu().double().numpy()
        return float(back[0]), back[1:]

    if captured is not None:
        try:
            fun = GraphedEvaluation(captured, params, fun)
        except RuntimeError as err:  # the capture met an operation a CUDA graph cannot hold
            warnings.warn(f"ks.fit: evaluating without a CUDA graph ({err})", RuntimeWarning, stacklevel=3)
    converged, n_iter, message, _ = lbfgs_numpy(fun, sum(sizes), max_iter, tol, progress)
    return converged, n_iter, message


def lbfgs_numpy(fun: Callable[[np.ndarray], tuple[float, np.ndarray]], size: int, max_iter: int, tol: float,
                progress: bool) -> tuple[bool, int, str, np.ndarray]:
    """``scipy.optimize.minimize(method="L-BFGS-B")`` of ``fun(x) -> (f, gradient)`` (float64 NumPy,
    ``x`` of ``size`` values) from ``x = 0``; returns ``(converged, iterations, message, x)``, and
    ``fun``'s last evaluation was at that ``x``.

    Stops when the largest gradient component is at most ``tol`` or when an iteration reduces the
    objective by less than rounding (``ftol`` of 10 float64 ulps, relative). A non-finite ``f`` or
    gradient is an infinite objective.
    """
    from scipy.optimize import minimize
    from tqdm.auto import tqdm

    last = {}

    def checked(x):
        f, grad = fun(x)
        last.update(f=f, x=np.array(x, copy=True), grad=grad)
        return (f, grad) if math.isfinite(f) and np.all(np.isfinite(grad)) else (math.inf, np.zeros_like(grad))

    with tqdm(total=max_iter, disable=not progress, desc="ks.fit", unit="it") as bar:
        def callback(xk):
            bar.update(1)
            bar.set_postfix(objective=f"{last['f']:.6g}", refresh=False)

        res = minimize(checked, np.zeros(size), jac=True, method="L-BFGS-B", callback=callback if progress else None,
                       options=dict(maxiter=max_iter, gtol=tol, ftol=10 * np.finfo(np.float64).eps, maxcor=20))
        _finish(bar, bool(res.success))
    if not np.array_equal(last["x"], res.x):
        checked(res.x)
    f, grad = last["f"], last["grad"]
    gmax = float(np.max(np.abs(grad))) if grad.size else 0.0
    if not math.isfinite(f):
        return False, int(res.nit), "the objective or its gradient became non-finite", res.x
    message = res.message if isinstance(res.message, str) else res.message.decode()
    return bool(res.success), int(res.nit), f"{message.lower()} (max gradient {gmax:.2e})", res.x


def _finish(bar, converged: bool) -> None:
    """End the bar at 100% when the fit stops before ``max_iter``, saying whether it converged."""
    if bar.disable:
        return
    bar.total = max(bar.n, 1)
    if bar.n == 0:
        bar.update(1)
    bar.set_postfix_str("converged" if converged else "stopped, not converged", refresh=False)
    bar.refresh()


def adam(objective: Objective, u: dict[str, torch.Tensor], max_iter: int, tol: float, progress: bool,
         lr: float = 0.05, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> tuple[bool, int, str]:
    """Adam (Kingma and Ba) with bias correction, written out to keep ``torch.optim`` unneeded."""
    from tqdm.auto import tqdm

    params = list(u.values())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    with tqdm(total=max_iter, disable=not progress, desc="ks.fit", unit="it") as bar:
        for it in range(max_iter + 1):
            for p in params:
                p.grad = None
            try:
                loss = objective(u)
            except ValueError:  # a parameter under- or overflowed
                _finish(bar, False)
                return False, it, "the objective or its gradient became non-finite"
            loss.backward()
            f = float(loss.detach())
            gmax = max(float(p.grad.abs().max()) for p in params)
            bar.set_postfix(objective=f"{f:.6g}", grad=f"{gmax:.2e}", refresh=False)
            if not math.isfinite(f) or not math.isfinite(gmax):
                _finish(bar, False)
                return False, it, "the objective or its gradient became non-finite"
            if gmax <= tol:
                _finish(bar, True)
                return True, it, f"gradient below tol ({gmax:.2e})"
            if it == max_iter:
                break
            with torch.no_grad():
                for p, mi, vi in zip(params, m, v):
                    mi.mul_(betas[0]).add_(p.grad, alpha=1 - betas[0])
                    vi.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
                    step = lr * (mi / (1 - betas[0] ** (it + 1))) / ((vi / (1 - betas[1] ** (it + 1))).sqrt() + eps)
                    p.sub_(step)
            bar.update(1)
    return False, max_iter, f"reached max_iter = {max_iter} (max gradient {gmax:.2e})"
