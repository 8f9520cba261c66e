"""The KLA scan: a grid of independent scalar information-form Kalman filters per token.

One module per backend, each with ``kla_scan(v, lam_v, k, q, decay, noise, initial_state=None)
-> (y, y_var, state)``: :mod:`~kalmanscan.ops.kla.reference` (the float64 recursion in mean-and-
variance form, the oracle, itself checked against 120-digit arithmetic in ``tests/kla_oracle.py``),
:mod:`~kalmanscan.ops.kla.torch` (time-parallel scans), :mod:`~kalmanscan.ops.kla.recurrent`
(token by token in torch operations), :mod:`~kalmanscan.ops.kla.cpu` (compiled loops, the default
on a CPU) and :mod:`~kalmanscan.ops.kla.triton` (fused kernels); the dispatch and registry
are in :mod:`~kalmanscan.ops.kla.dispatch`, the fused kernels' ``torch.library`` operators in
:mod:`~kalmanscan.ops.kla.triton.library`.

    y, y_var = kla_scan(v, lam_v, k, q, decay, noise)            # checked: one device-to-host sync
    y, y_var = kla_scan_unchecked(v, lam_v, k, q, decay, noise)  # valid by construction: no sync

Shapes: ``v``, ``lam_v`` ``(B, L, M)``; ``k``, ``q`` ``(B, L, S)``; ``decay``, ``noise`` ``(M, S)``;
the state ``(lam, eta)`` ``(B, M, S)``; ``y``, ``y_var`` ``(B, L, M)``. Per token and filter
``(m, s)`` (docs/math.md), starting from ``lam = 1, eta = 0`` unless ``initial_state`` is given:

    phi = lam_v[m] k[s]^2,   rho = 1 / (decay^2 + noise lam)
    lam <- rho lam + phi,    eta <- rho decay eta + lam_v[m] v[m] k[s]
    y[m] = sum_s q[s] eta / lam,    y_var[m] = sum_s q[s]^2 / lam

This is the filter of docs/math.md with ``a = decay``, ``q = noise``, ``phi = lam_v k^2`` and
``b = lam_v v k``, so the ``"torch"`` backend reuses :mod:`kalmanscan.model.mobius` and
:func:`kalmanscan.model.scan.associative_scan`: a Möbius scan for ``lam``, then an affine scan for ``eta``.
It materialises ``(B, L, M, S)`` tensors (memory ``O(B L M S)``) and is the differentiable oracle of
the fused ``"triton"`` backend (:mod:`kalmanscan.ops.kla.triton`), which keeps the state in registers.
The ``"recurrent"`` backend runs :func:`kla_step` token by token (``L`` steps of ``O(B M S)``
work, the same mean form; autograd through the loop, so it also gives second derivatives). The
``"cpu"`` backend runs the same mean-form recursion as compiled loops over time, parallel over
batch rows and channel blocks, with an exact compiled backward (docs/performance.md: forward and
backward 20 to 220 times the recurrent backend's speed on a 2-core CPU); ``"auto"`` picks it for
CPU tensors.

The state. Without process noise (``noise = 0``, the gated-linear-attention limit) and with
``decay < 1`` the exact precision grows like ``decay^(-2t)`` and ``eta`` like ``decay^(-t)``: both
leave float32's range within tens to hundreds of tokens (float64's later). The torch backend
therefore scans the variance ``var = 1/lam`` and the mean ``mu = eta/lam``, which only underflow
towards their exact limit 0, and the returned :class:`FilterState` carries them: continuing from
it (``initial_state=state``, chunked prefill) or stepping it (:func:`kla_step`, decoding) is exact
at every length. The state also unpacks as the pair ``(lam, eta)``.

Packed documents: ``kla_scan(..., cu_seqlens=offsets)`` takes ``N`` documents laid end to end in
one row ``(1, total, ...)`` with fla's int32 offsets ``(N + 1,)``; the filters restart at each
document's first token (from an optional ``(N, M, S)`` initial state) and the state has one row
per document (:mod:`~kalmanscan.ops.kla.documents`), on every backend.

Dtypes: half-precision inputs compute in float32 and return their dtype; the torch backend computes
in float64 when any input is float64, and so does the cpu backend; the triton backend always
computes in float32. The returned
state is in the compute dtype (keep it in float32 or better when decoding).
"""

from __future__ import annotations

from kalmanscan.ops.kla.dispatch import (NOISE_FLOOR, backend_names, check_shapes, kla_scan, kla_scan_unchecked,
                                         register_backend, validate)
from kalmanscan.ops.kla.state import FilterState, compute_dtype, information

__all__ = ["kla_scan", "kla_scan_unchecked", "register_backend", "backend_names", "validate", "check_shapes",
           "FilterState", "information", "compute_dtype", "NOISE_FLOOR"]
