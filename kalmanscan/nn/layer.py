"""The Kalman Linear Attention block (Shaj et al., arXiv 2602.10743, Figure 7), docs/math.md.

    x (B, L, D) -> in_proj -> z, gate (B, L, M)            M = expand * D
    z -> causal depthwise conv1d (width d_conv) -> SiLU
    z -> v, log obs-variance (B, L, M);  k, q (B, L, S), L2-normalised per token
    OU parameters theta, sigma, dt (M, S) -> decay, noise      (kalmanscan.ou.discretize)
    (v, lam_v, k, q, decay, noise) -> kla_scan -> y, y_var (B, L, M)
    (y + D_skip * z) * SiLU(gate) -> out_proj -> (B, L, D)

Recurrent decoding carries :class:`KLAState` ``(conv, var, mu)``: the last ``d_conv - 1`` pre-conv
inputs ``(B, d_conv - 1, M)`` and the filters' variance and mean ``(B, M, S)``, with the precision
and information mean ``lam = 1/var``, ``eta = mu/var`` as properties. The variance and mean stay in
range at every length, also without process noise, where the precision overflows
(:mod:`kalmanscan.ops.kla`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ou
from ..ops.kla import FilterState, backend_names, information, kla_scan
from ..ops.kla.recurrent import kla_step
from .common import causal_conv, init_log_dt, init_log_rates, inner_width, l2_normalize, positive_ints, scan_dtype

__all__ = ["KLA", "KLAState", "forward_with"]

_OBS_VAR_FLOOR = 1e-4
_VARIANTS = ("plain", "mamba")


_FORWARD = contextvars.ContextVar("kalmanscan_kla_forward", default=None)


@contextlib.contextmanager
def forward_with(runner: Any, layers: Iterable[KLA]) -> Iterator[None]:
    """Inside the block, ``layer(x, state, return_variance)`` for each :class:`KLA` in ``layers``
    returns ``runner(layer, x, state, return_variance)`` instead of the block's own forward.

    The hook through which a caller runs whole layers another way (e.g.
    :func:`kalmanscan.distributed.sequence_parallel`, which splits the sequence across processes)
    without replacing methods; other layers, other threads and code after the block are unaffected.
    """
    token = _FORWARD.set((frozenset(id(m) for m in layers), runner))
    try:
        yield
    finally:
        _FORWARD.reset(token)


class KLAState(NamedTuple):
    """Recurrent state of one :class:`KLA` layer.

    ``conv`` (B, d_conv - 1, M): the last pre-conv inputs; ``var``, ``mu`` (B, M, S): the filters'
    variance and mean (float32, or float64 for a float64 layer). Without process noise and with
    ``decay < 1`` they only underflow towards their exact limit 0, so decoding and chunked prefill
    stay exact at every length. ``lam`` and ``eta`` are the precision and information mean
    ``1/var``, ``mu/var``: exact where in range, ``inf`` (never NaN) where the exact precision is
    beyond it (:func:`kalmanscan.ops.kla.information`).
    """

    conv: torch.Tensor
    var: torch.Tensor
    mu: torch.Tensor

    @property
    def lam(self) -> torch.Tensor:
        return information(self.var, self.mu)[0]

    @property
    def eta(self) -> torch.Tensor:
        return information(self.var, self.mu)[1]


class KLA(nn.Module):
    """Kalman Linear Attention: a grid of ``M x S`` independent scalar Kalman filters per layer.

    Args:
        d_model: model width D.
        d_state: S, state (key/query) dimension per channel.
        expand: M = expand * D channels (an integer result is required).
        variant: ``"plain"`` (full-width projections of z to v and to the log obs-variance) or
            ``"mamba"`` (v = z, and the log obs-variance through a rank ``var_rank`` bottleneck,
            default ``ceil(D / 8)`` as in the paper's code).
        discretization: ``"ou"`` (exact OU step) or ``"zoh"`` (the zero-order-hold ablation).
        d_conv: width of the causal depthwise conv.
        dt_min, dt_max: range of the log-uniform initial step.
        sigma_init: initial OU diffusion scale.
        theta_init: ``"s4d"`` (the rates ``1..S`` below) or a positive number, the rate every
            filter starts at (``1.0`` is the paper's code, ``a = -1``).
        skip_init: initial value of the per-channel skip ``D_skip``.
        backend: forwarded to :func:`kalmanscan.nn.kla_scan` (``"auto"``, ``"torch"``, ``"triton"``,
            ``"recurrent"``).

    OU parameters (each (M, S), stored as logs so they stay positive):

    * ``dt = exp(log_dt)``, log-uniform in ``[dt_min, dt_max] = [1e-3, 1e-1]`` at init, per (m, s):
      the paper's code and Mamba use this range (the paper stores it through a softplus; the log
      gives the same initial values and keeps dt positive without a floor).
    * ``theta = exp(log_theta)``, by default the S4D-real initialisation ``theta[m, s] = s + 1``
      (Mamba's ``A``): the paper's code starts every rate at 1 (``a = -exp(0)``, here
      ``theta_init=1.0``), which is our ``s = 0`` row; spreading the rates over ``1..S`` gives each
      channel a range of memory lengths from the first step, ``decay = exp(-theta dt)`` from about
      0.2 to 0.999, at no cost in parameters.
    * ``sigma = exp(log_sigma)``, ``sigma_init = 0.1``: ``sigma^2 = 0.01`` is the paper's initial
      continuous process noise (its ``process_noise_scale``, reported best of those tried).

    ``decay, noise = ou.discretize(theta, sigma, dt, discretization)`` (the toolkit's own code).

    Numerics: projections run in the input dtype (bf16 under autocast); the scan and the OU
    parameters run in float32 (float64 for a float64 layer). ``lam_v = 1 / (softplus(.) + 1e-4)``
    is at most 1e4.
    """

    def __init__(self, d_model: int, d_state: int = 16, expand: float = 2, variant: str = "plain",
                 discretization: str = "ou", d_conv: int = 4, *, var_rank: int | None = None,
                 dt_min: float = 1e-3, dt_max: float = 1e-1, sigma_init: float = 0.1,
                 theta_init: str | float = "s4d", skip_init: float = -1.0, backend: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        positive_ints(d_model=d_model, d_state=d_state, d_conv=d_conv)
        M, S = inner_width(d_model, expand), d_state
        if variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
        if discretization not in ("ou", "zoh"):
            raise ValueError(f"discretization must be 'ou' or 'zoh', got {discretization!r}")
        if backend not in backend_names():
            raise ValueError(f"backend must be one of {backend_names()}, got {backend!r}")
        if not sigma_init > 0:
            raise ValueError(f"sigma_init must be positive, got {sigma_init!r}")
        if theta_init != "s4d" and (isinstance(theta_init, str) or not theta_init > 0):
            raise ValueError(f"theta_init must be 's4d' or a positive number, got {theta_init!r}")
        if var_rank is not None and (variant != "mamba" or var_rank < 1):
            raise ValueError(f"var_rank applies to variant='mamba' and must be >= 1, got {var_rank!r}")
        factory = dict(device=device, dtype=dtype)
        self.d_model, self.d_inner, self.d_state, self.d_conv = d_model, M, S, d_conv
        self.variant, self.discretization, self.backend = variant, discretization, backend

        self.in_proj = nn.Linear(d_model, 2 * M, bias=False, **factory)
        self.conv = nn.Conv1d(M, M, d_conv, groups=M, bias=True, **factory)
        if variant == "plain":
            self.var_rank = M
            self.sensor_proj = nn.Linear(M, 2 * M + 2 * S, bias=False, **factory)
            self.var_expand = None
        else:
            self.var_rank = var_rank or math.ceil(d_model / 8)
            self.sensor_proj = nn.Linear(M, self.var_rank + 2 * S, bias=False, **factory)
            self.var_expand = nn.Linear(self.var_rank, M, bias=False, **factory)
        self.out_proj = nn.Linear(M, d_model, bias=False, **factory)

        self.log_dt = nn.Parameter(init_log_dt((M, S), dt_min, dt_max, **factory))
        self.log_theta = nn.Parameter(
            init_log_rates(M, S, **factory) if theta_init == "s4d"
            else torch.full((M, S), math.log(theta_init), **factory))
        self.log_sigma = nn.Parameter(torch.full((M, S), math.log(sigma_init), **factory))
        self.skip = nn.Parameter(torch.full((M,), float(skip_init), **factory))
        for p in (self.log_dt, self.log_theta, self.log_sigma, self.skip):
            p._no_weight_decay = True

    def ou_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(theta, sigma, dt)``, each (M, S), in float32 (float64 for a float64 layer)."""
        dtype = scan_dtype(self.log_dt)
        return tuple(torch.exp(p.to(dtype)) for p in (self.log_theta, self.log_sigma, self.log_dt))

    def discretized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(decay, noise)``, each (M, S): the OU prior over one token step."""
        return ou.discretize(*self.ou_params(), method=self.discretization)

    def init_state(self, batch: int, device: torch.device | str | None = None) -> KLAState:
        """The state before the first token: zero conv window, ``var = 1``, ``mu = 0``."""
        device = self.log_dt.device if device is None else device
        dtype = scan_dtype(self.log_dt)
        conv = torch.zeros(batch, self.d_conv - 1, self.d_inner, device=device,
                           dtype=self.in_proj.weight.dtype)
        var = torch.ones(batch, self.d_inner, self.d_state, device=device, dtype=dtype)
        return KLAState(conv, var, torch.zeros_like(var))

    def observe(self, x: torch.Tensor, window: torch.Tensor | None = None) -> tuple[Any, ...]:
        """What the filters see of ``x`` (B, L, D): ``(z, gate, window, (v, lam_v, k, q))``.

        ``z`` (B, L, M) is the conv + SiLU output, ``gate`` (B, L, M) the output gate before its
        SiLU, ``window`` the new pre-conv window (``window=None``: zeros, a sequence's start), and
        ``v, lam_v`` (B, L, M), ``k, q`` (B, L, S) the scan's inputs (:func:`kla_scan`) in the scan
        dtype: filter ``(m, s)`` observes ``v[m]`` through the gain ``k[s]`` with precision ``lam_v[m]``.
        """
        z, gate = self.in_proj(x).chunk(2, -1)
        if window is None:
            window = z.new_zeros(z.shape[0], self.d_conv - 1, self.d_inner)
        z, window = causal_conv(z, window, self.conv)
        z = F.silu(z)
        return z, gate, window, self.sensors(z)

    def sensors(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """z (..., M) -> v, lam_v (..., M); k, q (..., S) L2-normalised; all in the scan dtype."""
        M, S, r = self.d_inner, self.d_state, self.var_rank
        if self.variant == "plain":
            v, log_var, k, q = self.sensor_proj(z).split([M, M, S, S], -1)
        else:
            log_var, k, q = self.sensor_proj(z).split([r, S, S], -1)
            v, log_var = z, self.var_expand(log_var)
        dtype = scan_dtype(z)
        lam_v = 1.0 / (F.softplus(log_var.to(dtype)) + _OBS_VAR_FLOOR)
        k, q = l2_normalize(k.to(dtype)), l2_normalize(q.to(dtype))
        return v.to(dtype), lam_v, k, q

    def check_input(self, x: Any, ndim: int, name: str) -> None:
        """``ValueError`` naming ``name`` unless ``x`` is ``(B, L, D)`` (``ndim`` 3) or ``(B, D)``."""
        if x.ndim != ndim or x.shape[-1] != self.d_model:
            want = "(B, L, D)" if ndim == 3 else "(B, D)"
            raise ValueError(f"{name} must have shape {want} with D = {self.d_model}, "
                             f"got {tuple(x.shape)}")

    def read_out(self, y: torch.Tensor, y_var: torch.Tensor, z: torch.Tensor, gate: torch.Tensor,
                 return_variance: bool) -> tuple[torch.Tensor, ...]:
        """The block's output from the scan's ``y, y_var`` (B, L, M): ``out_proj((y + D_skip z)
        SiLU(gate))``, and with ``return_variance`` the variance through the squared gate and
        weights. Returns a tuple: ``(out,)`` or ``(out, out_var)``."""
        g = F.silu(gate)
        out = self.out_proj((y.to(z.dtype) + self.skip.to(z.dtype) * z) * g)
        if not return_variance:
            return (out,)
        with torch.autocast(y_var.device.type, enabled=False):
            g2 = g.to(y_var.dtype).square()
            out_var = F.linear(y_var * g2, self.out_proj.weight.to(y_var.dtype).square())
        return out, out_var

    def forward(self, x: torch.Tensor, state: KLAState | None = None,
                return_variance: bool = False) -> torch.Tensor | tuple[Any, ...]:
        """Run the block over a whole sequence (or a chunk of one, continuing ``state``).

        x: (B, L, D). Returns ``y`` (B, L, D); ``(y, y_var)`` with ``return_variance``; and, when a
        ``state`` is given, the new state appended: ``(y, state)`` or ``(y, y_var, state)``.

        ``y_var`` (B, L, D, float32) is the paper's propagated output variance and is an
        approximation: it treats the scan outputs of different channels as independent given the
        inputs, the gate and skip as deterministic, and maps ``y_var * SiLU(gate)^2`` through the
        squared output weights; it ignores the projections' own uncertainty.
        """
        runner = _FORWARD.get()
        if runner is not None and id(self) in runner[0]:
            return runner[1](self, x, state, return_variance)
        self.check_input(x, 3, "x")
        z, gate, window, (v, lam_v, k, q) = self.observe(x, None if state is None else state.conv)
        decay, noise = self.discretized()
        initial = None if state is None else FilterState.from_moments(state.var, state.mu)
        with torch.autocast(x.device.type, enabled=False):
            y, y_var, final = kla_scan(v, lam_v, k, q, decay.to(v.dtype), noise.to(v.dtype),
                                            initial_state=initial, return_state=True,
                                            backend=self.backend)
        out = self.read_out(y, y_var, z, gate, return_variance)
        if state is not None:
            out = out + (KLAState(window, final.var, final.mu),)
        return out if len(out) > 1 else out[0]

    def step(self, x_t: torch.Tensor, state: KLAState, return_variance: bool = False) -> tuple[Any, ...]:
        """Advance by one token in O(M S) work: x_t (B, D) -> ``(y_t, state)`` (or ``(y_t, y_var_t,
        state)``), y_t (B, D).

        The same predict-then-update as the scan for one token, in the mean form of
        :func:`kalmanscan.ops.kla.kla_step` (variance and mean, finite without process noise).
        """
        self.check_input(x_t, 2, "x_t")
        z, gate = self.in_proj(x_t).chunk(2, -1)
        z, window = causal_conv(z[:, None], state.conv, self.conv)
        z = F.silu(z[:, 0])
        v, lam_v, k, q = self.sensors(z)
        decay, noise = self.discretized()
        with torch.autocast(x_t.device.type, enabled=False):
            y, y_var, var, mu = kla_step(v, lam_v, k, q, decay, noise, state.var.to(v.dtype),
                                         state.mu.to(v.dtype))
        out = self.read_out(y, y_var, z, gate, return_variance)
        return out + (KLAState(window, var, mu),)
