"""The toolkit filter and smoother: one registry of backends, one dispatch for both.

Every backend is a module with the same functions and signatures:

    filter(p: Problem) -> dict         # the filter's fields, tensors broadcastable to p.shape
    smooth(f: dict, mean_param) -> (mean, var, precision)    # RTS from the filter's tensors
    summary(p: Problem) -> 7 tensors   # merged-form product of p's steps (kalmanscan.model.merged);
                                       # optional: kalmanscan.distributed needs it

``p`` is a validated :class:`kalmanscan.problem.problem.Problem`; the dict holds ``mean, var, precision,
pred_mean, pred_var, pred_precision, pred_obs_mean, pred_obs_var, logliks, decay, noise,
missing`` (NumPy arrays are accepted and converted), and optionally ``loglik``, the sum of
``logliks`` over time ``(..., C)``, where the backend sums it as it goes (the triton walks). When
``p.outputs`` names fields, the dict may hold those alone: ``decay, noise`` left out are taken
from ``p.decay_noise()`` by the callers that read them.
Built in: ``"reference"`` (sequential float64
covariance form, the oracle), ``"torch"`` (time-parallel scans, any device, differentiable),
``"triton"`` (fused GPU kernels) and ``"cpu"`` (a compiled sequential loop); ``"auto"`` is triton
on CUDA and the compiled loop on the CPU. :func:`register_backend` adds a name that
:func:`kalmanscan.filter` and :func:`kalmanscan.smooth` then accept.
"""

from __future__ import annotations

from kalmanscan.ops.filter.dispatch import backend_names, get_backend, register_backend, resolve_backend, run_backend

__all__ = ["register_backend", "backend_names", "resolve_backend", "get_backend", "run_backend"]
