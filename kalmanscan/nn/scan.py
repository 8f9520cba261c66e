"""The KLA scan: a grid of independent scalar information-form Kalman filters per token.

    y, y_var = kla_scan(v, lam_v, k, q, decay, noise)

Shapes: ``v``, ``lam_v`` ``(B, L, M)``; ``k``, ``q`` ``(B, L, S)``; ``decay``, ``noise`` ``(M, S)``;
the state ``(lam, eta)`` ``(B, M, S)``; ``y``, ``y_var`` ``(B, L, M)``. Per token and filter
``(m, s)`` (DESIGN.md section 3), starting from ``lam = 1, eta = 0`` unless ``initial_state`` is given:

    phi = lam_v[m] k[s]^2,   rho = 1 / (decay^2 + noise lam)
    lam <- rho lam + phi,    eta <- rho decay eta + lam_v[m] v[m] k[s]
    y[m] = sum_s q[s] eta / lam,    y_var[m] = sum_s q[s]^2 / lam

This is the filter of DESIGN.md section 2 with ``a = decay``, ``q = noise``, ``phi = lam_v k^2`` and
``b = lam_v v k``, so the ``"torch"`` backend reuses :mod:`kalmanscan.mobius` and
:func:`kalmanscan.scan.associative_scan`: a Möbius scan for ``lam``, then an affine scan for ``eta``.
It materialises ``(B, L, M, S)`` tensors (memory ``O(B L M S)``) and is the differentiable oracle of
the fused ``"triton"`` backend (:mod:`kalmanscan.nn.kla_triton`), which keeps the state in registers.
The ``"recurrent"`` backend runs :func:`kla_step` token by token (``L`` steps of ``O(B M S)``
work, the same mean form; autograd through the loop): fewer operations than the parallel scan, so
the faster of the two on a CPU once a token's ``B M S`` filters number a few thousand.

The state. Without process noise (``noise = 0``, the gated-linear-attention limit) and with
``decay < 1`` the exact precision grows like ``decay^(-2t)`` and ``eta`` like ``decay^(-t)``: both
leave float32's range within tens to hundreds of tokens (float64's later). The torch backend
therefore scans the variance ``var = 1/lam`` and the mean ``mu = eta/lam``, which only underflow
towards their exact limit 0, and the returned :class:`FilterState` carries them: continuing from
it (``initial_state=state``, chunked prefill) or stepping it (:func:`kla_step`, decoding) is exact
at every length. The state also unpacks as the pair ``(lam, eta)``.

Dtypes: half-precision inputs compute in float32 and return their dtype; the torch backend computes
in float64 when any input is float64; the triton backend always computes in float32. The returned
state is in the compute dtype (keep it in float32 or better when decoding).
"""

from __future__ import annotations

import math
import os

import torch

from .. import mobius
from ..scan import associative_scan

__all__ = ["kla_scan", "kla_step", "kla_scan_recurrent", "kla_scan_sequential", "FilterState",
           "KLA_BACKENDS", "RECURRENT_MIN_WIDTH"]

KLA_BACKENDS = ("auto", "torch", "triton", "recurrent")
RECURRENT_MIN_WIDTH = 4096   # B * M * S from which "auto" scans CPU tensors token by token


def information(var, mu):
    """``(lam, eta) = (1 / var, mu / var)`` from the variance ``var >= 0`` and the mean ``mu``.

    Where ``var`` underflowed to 0 the exact precision is beyond the range: ``lam = inf`` and
    ``eta = +-inf``, or 0 where ``mu`` underflowed to 0 as well (their ratio is lost; never NaN).
    """
    return 1.0 / var, torch.where(mu == 0, mu, mu / var)


class FilterState(tuple):
    """The ``(B, M, S)`` filters' state returned by :func:`kla_scan`: a pair that unpacks as the
    precision and information mean ``(lam, eta)``, and carries the variance and mean ``var``,
    ``mu`` that :func:`kla_scan` continues from when given it as ``initial_state``.

    ``var`` and ``mu`` stay exact in the floating-point range at every length (they only
    underflow towards 0); ``lam`` and ``eta`` are exact where in range and follow
    :func:`information` beyond it (``inf``, never NaN).
    """

    def __new__(cls, lam, eta, var, mu):
        state = super().__new__(cls, (lam, eta))
        state.var, state.mu = var, mu
        return state

    def __getnewargs__(self):
        return (*self, self.var, self.mu)

    @classmethod
    def from_moments(cls, var, mu):
        """The state of variance ``var >= 0`` and mean ``mu``."""
        return cls(*information(var, mu), var, mu)

    @classmethod
    def from_information(cls, lam, eta):
        """The state of precision ``lam > 0`` and information mean ``eta``."""
        var = 1.0 / lam
        return cls(lam, eta, var, eta * var)

    def to(self, dtype):
        """The four tensors cast to ``dtype``."""
        return FilterState(*(x.to(dtype) for x in (*self, self.var, self.mu)))


def kla_scan(v, lam_v, k, q, decay, noise, *, initial_state=None, return_state=False, backend="auto"):
    """Run the KLA filters over the sequence (see the module docstring for shapes and numerics).

    Returns ``(y, y_var)``, or ``(y, y_var, state)`` with the final :class:`FilterState` (it
    unpacks as ``(lam, eta)``) when ``return_state`` is true. ``initial_state`` is a pair
    ``(lam, eta)`` of ``(B, M, S)`` tensors with ``lam > 0``, or a :class:`FilterState` (continued
    from its ``var`` and ``mu``). ``backend`` is ``"torch"`` (the time-parallel scan),
    ``"triton"``, ``"recurrent"`` (:func:`kla_scan_recurrent`, token by token) or ``"auto"``: triton
    for CUDA tensors; on a CPU recurrent where a token's ``B M S`` filters number at least
    :data:`RECURRENT_MIN_WIDTH` (there it is several times faster), torch otherwise.
    Filters with ``decay < 1`` and no process noise (``noise``
    below :data:`kalmanscan.mobius.NO_NOISE`), and initial states whose variance is below it, run
    on the torch backend when ``backend`` is triton: their precision is past the range of the fused
    kernels, which carry it, while the torch backend scans the variance and the mean. Raises
    ``ValueError`` naming the offending argument.
    """
    mean_form = _validate(v, lam_v, k, q, decay, noise, initial_state, backend)
    if backend == "auto":
        wide = v.shape[0] * v.shape[2] * k.shape[-1] >= RECURRENT_MIN_WIDTH
        backend = "triton" if v.is_cuda else "recurrent" if v.device.type == "cpu" and wide else "torch"
    if backend == "triton" and not mean_form:
        from .kla_triton import kla_scan_triton

        lam0, eta0 = (None, None) if initial_state is None else initial_state
        y, y_var, lam, eta = kla_scan_triton(v, lam_v, k, q, decay, noise, lam0, eta0)
        state = FilterState.from_information(lam, eta)
    elif backend == "recurrent":
        y, y_var, state = kla_scan_recurrent(v, lam_v, k, q, decay, noise, initial_state)
    else:
        y, y_var, state = kla_scan_torch(v, lam_v, k, q, decay, noise, initial_state)
    y, y_var = y.to(v.dtype), y_var.to(v.dtype)
    return (y, y_var, state) if return_state else (y, y_var)


def compute_dtype(*tensors):
    """float64 if any tensor is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _prepare(v, lam_v, k, q, decay, noise, initial_state):
    """The inputs in the compute dtype and the initial :class:`FilterState` (``lam = 1, eta = 0``
    for ``None``; from a ``(lam, eta)`` pair; a given :class:`FilterState` cast)."""
    dtype = compute_dtype(v, lam_v, k, q, decay, noise)
    v, lam_v, k, q, decay, noise = (x.to(dtype) for x in (v, lam_v, k, q, decay, noise))
    if initial_state is None:
        B, _, M = v.shape
        ones = torch.ones(B, M, k.shape[-1], dtype=dtype, device=v.device)
        zeros = torch.zeros_like(ones)
        initial_state = FilterState(ones, zeros, ones, zeros)
    elif not isinstance(initial_state, FilterState):
        initial_state = FilterState.from_information(*(x.to(dtype) for x in initial_state))
    return v, lam_v, k, q, decay, noise, initial_state.to(dtype)


def kla_scan_torch(v, lam_v, k, q, decay, noise, initial_state=None):
    """Time-parallel KLA scan in torch ops; returns ``(y, y_var, state)`` in the compute dtype.

    ``initial_state`` is a pair ``(lam, eta)``, a :class:`FilterState` or ``None`` (``lam = 1,
    eta = 0``); ``state`` is a :class:`FilterState`. Differentiable by autograd. The precision
    scan is read out as the variance (:func:`kalmanscan.mobius.propagate_var`, from the initial
    variance) and the mean is scanned in mean form (:mod:`kalmanscan.mobius`), so ``noise = 0``
    (whose exact precision grows like ``decay^(-2t)``) gives finite outputs and a final ``var``,
    ``mu`` that continue exactly; only the state's pair ``(lam, eta)`` may then be inf.
    """
    v, lam_v, k, q, decay, noise, initial_state = _prepare(v, lam_v, k, q, decay, noise, initial_state)
    B, L, M = v.shape
    S = k.shape[-1]
    if L == 0:
        empty = v.new_zeros(B, 0, M)
        return empty, empty, initial_state
    var0, mu0 = (x.unsqueeze(1) for x in (initial_state.var, initial_state.mu))
    shape = (B, L, M, S)
    kk = k.unsqueeze(-2)
    phi = lam_v.unsqueeze(-1) * kk * kk
    b = (lam_v * v).unsqueeze(-1) * kk
    a = decay.expand(shape)
    n = noise.expand(shape)
    P = associative_scan(mobius.compose, mobius.leaf(a, n, phi), dim=1)
    var = mobius.propagate_var(P, var0)
    pred_var = a * a * torch.cat([var0, var[:, :-1]], 1) + n
    G, W = associative_scan(mobius.affine_compose, (mobius.mean_gate(a, pred_var, phi), b * var), dim=1)
    mu = G * mu0 + W
    qq = q.unsqueeze(-2)
    y = (qq * mu).sum(-1)
    y_var = (qq * qq * var).sum(-1)
    return y, y_var, FilterState.from_moments(var[:, -1], mu[:, -1])


def kla_scan_recurrent(v, lam_v, k, q, decay, noise, initial_state=None):
    """The KLA filters token by token in mean form (:func:`kla_step`), in the compute dtype.

    Same arguments and result as :func:`kla_scan_torch`; differentiable by autograd. ``L`` steps
    of O(B M S) work each, against the time-parallel scan's O(log L) levels of 2x2 Möbius products
    with rescaling: several times less arithmetic and memory traffic, so on a CPU it is the faster
    of the two once a step's ``B M S`` elements outweigh the per-step overhead (measured on 2 cores:
    3x at B 4, L 1024, M 128, S 16; 20x at B 64, L 64; 30x slower at B M S = 64, L 4096).
    """
    v, lam_v, k, q, decay, noise, state = _prepare(v, lam_v, k, q, decay, noise, initial_state)
    B, L, M = v.shape
    if L == 0:
        empty = v.new_zeros(B, 0, M)
        return empty, empty, state
    var, mu = state.var, state.mu
    ys, y_vars = [], []
    for t in range(L):
        y, y_var, var, mu = kla_step(v[:, t], lam_v[:, t], k[:, t], q[:, t], decay, noise, var, mu)
        ys.append(y)
        y_vars.append(y_var)
    return torch.stack(ys, 1), torch.stack(y_vars, 1), FilterState.from_moments(var, mu)


def kla_step(v, lam_v, k, q, decay, noise, var, mu):
    """One token of the scan in mean form, for decoding: ``(y, y_var, var, mu)``.

    ``v``, ``lam_v`` ``(B, M)``; ``k``, ``q`` ``(B, S)``; ``decay``, ``noise`` ``(M, S)``; the
    variance and mean ``var``, ``mu`` ``(B, M, S)`` before the token and after it; ``y``,
    ``y_var`` ``(B, M)``. With ``phi = lam_v k^2`` and ``pred_var = decay^2 var + noise``:

        var <- pred_var / (1 + phi pred_var),   mu <- g mu + lam_v v k var
        g = decay / (1 + phi pred_var)          (kalmanscan.mobius.mean_gate, in [0, decay])
        y = sum_s q mu,   y_var = sum_s q^2 var

    the same filter as the precision recursion of :func:`kla_scan_sequential`
    (``var = 1/lam``, ``mu = eta/lam``), but without its overflow: with ``noise = 0`` the
    variance and mean only underflow towards their exact limit 0, and a variance of 0 stays 0.
    """
    kk = k.unsqueeze(-2)
    phi = lam_v.unsqueeze(-1) * kk * kk
    pred_var = decay * decay * var + noise
    var = pred_var / (1.0 + phi * pred_var)
    mu = mobius.mean_gate(decay, pred_var, phi) * mu + (lam_v * v).unsqueeze(-1) * kk * var
    qq = q.unsqueeze(-2)
    return (qq * mu).sum(-1), (qq * qq * var).sum(-1), var, mu


def kla_scan_sequential(v, lam_v, k, q, decay, noise, lam0=None, eta0=None):
    """The plain token-by-token recursion in float64: the independent oracle for both backends.

    Same shapes as :func:`kla_scan`; returns ``(y, y_var, lam, eta)`` as float64 tensors.
    Differentiable by autograd (O(L) graph; meant for small test shapes).
    """
    v, lam_v, k, q, decay, noise = (x.double() for x in (v, lam_v, k, q, decay, noise))
    B, L, M = v.shape
    S = k.shape[-1]
    lam = torch.ones(B, M, S, dtype=torch.float64, device=v.device) if lam0 is None else lam0.double()
    eta = torch.zeros(B, M, S, dtype=torch.float64, device=v.device) if eta0 is None else eta0.double()
    ys, y_vars = [], []
    for t in range(L):
        kt = k[:, t, None, :]
        phi = lam_v[:, t, :, None] * kt * kt
        rho = 1.0 / (decay * decay + noise * lam)
        lam = rho * lam + phi
        eta = rho * decay * eta + (lam_v[:, t] * v[:, t])[:, :, None] * kt
        qt = q[:, t, None, :]
        ys.append((qt * eta / lam).sum(-1))
        y_vars.append((qt * qt / lam).sum(-1))
    return torch.stack(ys, 1), torch.stack(y_vars, 1), lam, eta


def _validate(v, lam_v, k, q, decay, noise, initial_state, backend):
    """Check shapes, dtypes, devices and value ranges; return whether the filters need the mean
    form of the torch backend (a precision past the fused kernels' range, see :func:`kla_scan`)."""
    if backend not in KLA_BACKENDS:
        raise ValueError(f"backend must be one of {KLA_BACKENDS}, got {backend!r}")
    named = dict(v=v, lam_v=lam_v, k=k, q=q, decay=decay, noise=noise)
    for name, x in named.items():
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
    for name in ("decay", "noise"):
        if named[name].shape != (M, S):
            raise ValueError(f"{name} must have shape (M, S) = ({M}, {S}), got {tuple(named[name].shape)}")
    if backend == "triton" and not v.is_cuda and not _interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1)")
    ranges = [("lam_v", lam_v, lambda lo, hi: lo > 0 and hi < math.inf, "positive and finite"),
              ("decay", decay, lambda lo, hi: lo > 0 and hi <= 1, "in (0, 1]"),
              ("noise", noise, lambda lo, hi: lo >= 0 and hi < math.inf, "finite and >= 0")]
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError("initial_state must be a pair (lam, eta) of (B, M, S) tensors")
        for name, x in (("initial_state lam", initial_state[0]), ("initial_state eta", initial_state[1])):
            if not isinstance(x, torch.Tensor) or x.shape != (B, M, S) or x.device != v.device:
                raise ValueError(f"{name} must be a ({B}, {M}, {S}) tensor on {v.device}")
        if isinstance(initial_state, FilterState):
            ranges.append(("initial_state var", initial_state.var,
                           lambda lo, hi: lo >= 0 and hi < math.inf, "finite and >= 0"))
        else:
            ranges.append(("initial_state lam", initial_state[0],
                           lambda lo, hi: lo > 0 and hi < math.inf, "positive and finite"))
    ranges = [r for r in ranges if r[1].numel()]
    mean_form = False
    if ranges and not (v.is_cuda and torch.cuda.is_current_stream_capturing()):
        # One reduction per tensor and a single device-to-host copy (NaN fails every comparison);
        # the last row is the smallest noise among decaying filters (see kalmanscan.mobius).
        with torch.no_grad():
            rows = [torch.stack(torch.aminmax(x.detach())).double() for _, x, _, _ in ranges]
            rows.append(torch.stack(torch.aminmax(mobius.decaying_noise(decay, noise))).double())
            extrema = torch.stack(rows).tolist()
        smallest = extrema[-1][0]
        for (name, _, ok, what), (lo, hi) in zip(ranges, extrema):
            if not ok(lo, hi):
                raise ValueError(f"{name} must be {what}")
            if name == "initial_state var":  # a precision the noise bound 1/NO_NOISE exceeds
                smallest = min(smallest, lo)
        mean_form = mobius.precision_overflows(smallest, noise.dtype)
    return mean_form


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
