"""The Kalman Linear Attention block (Shaj et al., arXiv 2602.10743, Figure 7), docs/math.md.

    x (B, L, D) -> in_proj -> z, gate (B, L, M)            M = expand * D
    z -> causal depthwise conv1d (width d_conv) -> SiLU
    z -> v, log obs-variance (B, L, M);  k, q (B, L, S), L2-normalised per token
    OU parameters theta, sigma, dt (M, S) -> decay, noise      (kalmanscan.model.ou.discretize)
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

from kalmanscan.model import ou
from kalmanscan.ops.kla import FilterState, backend_names, information, kla_scan_unchecked
from kalmanscan.ops.kla.documents import check_cu_seqlens
from kalmanscan.ops.kla.step import conv_step, kla_decode_step
from kalmanscan.nn.common import (causal_conv, init_log_dt, init_log_rates, inner_width, l2_normalize, positive_ints,
                                  scan_dtype)
from kalmanscan.nn.init import DEFAULT_INIT, init_scheme, initial_log_sigma, obs_var_bias
from kalmanscan.nn.packed import document_conv, document_windows

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
            default ``ceil(D / 8)`` as in the paper's code); default: the scheme's (``"plain"``
            for ``init="kalmanscan"``, ``"mamba"`` for ``"authors"``).
        discretization: ``"ou"`` (exact OU step) or ``"zoh"`` (the zero-order-hold ablation).
        d_conv: width of the causal depthwise conv.
        init: the initialisation scheme, ``"authors"`` (the default: the authors' current code,
            one rate, noise from ``3 theta dt``, observation variance ``1/S`` through a zeroed
            projection and a bias, a scalar skip; :mod:`kalmanscan.nn.init`, where the MQAR
            comparison that chose it is summarised) or ``"kalmanscan"`` (the earlier default, below).
        dt_min, dt_max: range of the log-uniform initial step.
        sigma_init: initial OU diffusion scale (default: the scheme's, 0.1 for ``"kalmanscan"``,
            ``sqrt(3 theta dt)`` per filter for ``"authors"``).
        theta_init: ``"s4d"`` (the rates ``1..S`` below) or a positive number, the rate every
            filter starts at (``1.0`` is the paper's code, ``a = -1``); default: the scheme's.
        skip_init: initial value of the skip ``D_skip`` (per channel, (M,); a scalar for
            ``"authors"``).
        backend: forwarded to :func:`kalmanscan.nn.kla_scan` (``"auto"``, ``"triton"``, ``"cpu"``,
            ``"torch"``, ``"recurrent"``).

    OU parameters (each (M, S), stored as logs so they stay positive; ``init="kalmanscan"`` below,
    ``"authors"`` in :mod:`kalmanscan.nn.init`):

    * ``dt = exp(log_dt)``, log-uniform in ``[dt_min, dt_max] = [1e-3, 1e-1]`` at init, per (m, s):
      the paper's code and Mamba use this range (the paper stores it through a softplus; the log
      gives the same initial values and keeps dt positive without a floor).
    * ``theta = exp(log_theta)``, with ``init="kalmanscan"`` the S4D-real initialisation ``theta[m, s] = s + 1``
      (Mamba's ``A``): the paper's code starts every rate at 1 (``a = -exp(0)``, here
      ``theta_init=1.0``), which is our ``s = 0`` row; spreading the rates over ``1..S`` gives each
      channel a range of memory lengths from the first step, ``decay = exp(-theta dt)`` from about
      0.2 to 0.999, at no cost in parameters.
    * ``sigma = exp(log_sigma)``, with ``init="kalmanscan"`` ``sigma_init = 0.1``: ``sigma^2 = 0.01``
      is the paper's initial continuous process noise (its ``process_noise_scale``, reported best of those tried). With
      ``init="authors"`` the parameter is ``log_sigma_sq = log sigma^2`` (:meth:`noise_parameter`).

    ``decay, noise = ou.discretize(theta, sigma, dt, discretization)`` (the toolkit's own code).

    Numerics: projections run in the input dtype (bf16 under autocast); the scan and the OU
    parameters run in float32 (float64 for a float64 layer). ``lam_v = 1 / (softplus(.) + 1e-4)``
    is at most 1e4.
    """

    def __init__(self, d_model: int, d_state: int = 16, expand: float = 2, variant: str | None = None,
                 discretization: str = "ou", d_conv: int = 4, *, init: str = DEFAULT_INIT,
                 var_rank: int | None = None, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 sigma_init: float | None = None, theta_init: str | float | None = None,
                 skip_init: float = -1.0, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        positive_ints(d_model=d_model, d_state=d_state, d_conv=d_conv)
        M, S = inner_width(d_model, expand), d_state
        scheme = init_scheme(init)
        variant = scheme.variant if variant is None else variant
        theta_init = scheme.theta_init if theta_init is None else theta_init
        sigma_init = scheme.sigma_init if sigma_init is None else sigma_init
        if variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
        if discretization not in ("ou", "zoh"):
            raise ValueError(f"discretization must be 'ou' or 'zoh', got {discretization!r}")
        if backend not in backend_names():
            raise ValueError(f"backend must be one of {backend_names()}, got {backend!r}")
        if sigma_init is not None and not sigma_init > 0:
            raise ValueError(f"sigma_init must be positive, got {sigma_init!r}")
        if theta_init != "s4d" and (isinstance(theta_init, str) or not theta_init > 0):
            raise ValueError(f"theta_init must be 's4d' or a positive number, got {theta_init!r}")
        if var_rank is not None and (variant != "mamba" or var_rank < 1):
            raise ValueError(f"var_rank applies to variant='mamba' and must be >= 1, got {var_rank!r}")
        factory = dict(device=device, dtype=dtype)
        self.d_model, self.d_inner, self.d_state, self.d_conv = d_model, M, S, d_conv
        self.variant, self.discretization, self.backend, self.init = variant, discretization, backend, init
        self.log_noise_var = scheme.log_noise_var

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
        log_sigma = initial_log_sigma(self.log_theta.detach().exp(), self.log_dt.detach().exp(), sigma_init)
        if self.log_noise_var:
            self.log_sigma_sq = nn.Parameter(2.0 * log_sigma)
        else:
            self.log_sigma = nn.Parameter(log_sigma)
        self.skip = nn.Parameter(torch.full(() if scheme.scalar_skip else (M,), float(skip_init), **factory))
        self.obs_var_bias = None
        if scheme.obs_var_bias:
            self.obs_var_bias = nn.Parameter(torch.full((M,), obs_var_bias(S, _OBS_VAR_FLOOR), **factory))
            self.zero_obs_var_projection()
        if scheme.zero_conv_bias:
            with torch.no_grad():
                self.conv.bias.zero_()
        for p in (self.log_dt, self.log_theta, self.noise_parameter(), self.skip, self.obs_var_bias):
            if p is not None:
                p._no_weight_decay = True

    def noise_parameter(self) -> nn.Parameter:
        """The learned process noise: ``log_sigma``, or ``log_sigma_sq = log sigma^2`` for
        ``init="authors"`` (each (M, S)); filling it with ``-inf`` gives ``noise = 0``."""
        return self.log_sigma_sq if self.log_noise_var else self.log_sigma

    @torch.no_grad()
    def zero_obs_var_projection(self) -> None:
        """Zero the weights that produce the log observation-variance (``var_expand`` in the
        "mamba" block, those rows of ``sensor_proj`` in "plain") and mark the weight ``_no_reinit``
        (kept by ``SequenceModel(weight_init="normal")``), as the authors' scheme does."""
        if self.var_expand is not None:
            weight = self.var_expand.weight
            weight.zero_()
        else:
            weight = self.sensor_proj.weight
            weight[self.d_inner:2 * self.d_inner].zero_()
        weight._no_reinit = True

    def ou_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(theta, sigma, dt)``, each (M, S), in float32 (float64 for a float64 layer)."""
        dtype = scan_dtype(self.log_dt)
        log_noise = self.noise_parameter().to(dtype)           # log sigma, or log sigma^2
        sigma = torch.exp(0.5 * log_noise if self.log_noise_var else log_noise)
        return torch.exp(self.log_theta.to(dtype)), sigma, torch.exp(self.log_dt.to(dtype))

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

    def observe(self, x: torch.Tensor, window: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[Any, ...]:
        """What the filters see of ``x`` (B, L, D): ``(z, gate, window, (v, lam_v, k, q))``.

        ``z`` (B, L, M) is the conv + SiLU output, ``gate`` (B, L, M) the output gate before its
        SiLU, ``window`` the new pre-conv window (``window=None``: zeros, a sequence's start), and
        ``v, lam_v`` (B, L, M), ``k, q`` (B, L, S) the scan's inputs (:func:`kla_scan`) in the scan
        dtype: filter ``(m, s)`` observes ``v[m]`` through the gain ``k[s]`` with precision ``lam_v[m]``.
        With ``cu_seqlens`` (packed documents, ``B = 1``) the conv stays within each document
        (:func:`kalmanscan.nn.packed.document_conv`); ``window`` is then ``(N, d_conv - 1, M)``, one
        per document, and the new one each document's after its last token (``window=None``: each
        document starts from zeros, and the new window is ``None``).
        """
        z, gate = self.in_proj(x).chunk(2, -1)
        if cu_seqlens is not None:
            z, window = (document_conv(z, self.conv, cu_seqlens, window),
                         None if window is None else document_windows(z, cu_seqlens, window))
        else:
            if window is None:
                window = z.new_zeros(z.shape[0], self.d_conv - 1, self.d_inner)
            z, window = causal_conv(z, window, self.conv)
        z = F.silu(z)
        return z, gate, window, self.sensors(z)

    def sensors(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """z (..., M) -> v, lam_v (..., M); k, q (..., S) L2-normalised; all in the scan dtype.

        ``v`` is cast to float32 under autocast although the fused kernels read any float dtype: a
        bf16 ``v`` is one 2-byte load a lane, below the 4 bytes of an asynchronous copy, so Triton's
        software pipeliner leaves it a synchronous load in the forward's and piece map's loops
        (sm_90), and handing the kernels bf16 made the compiled model's step slower
        (docs/decisions.md, "The KLA scan")."""
        M, S, r = self.d_inner, self.d_state, self.var_rank
        if self.variant == "plain":
            v, log_var, k, q = self.sensor_proj(z).split([M, M, S, S], -1)
        else:
            log_var, k, q = self.sensor_proj(z).split([r, S, S], -1)
            v, log_var = z, self.var_expand(log_var)
        dtype = scan_dtype(z)
        log_var = log_var.to(dtype)
        if self.obs_var_bias is not None:
            log_var = log_var + self.obs_var_bias.to(dtype)
        lam_v = 1.0 / (F.softplus(log_var) + _OBS_VAR_FLOOR)
        k, q = l2_normalize(k.to(dtype)), l2_normalize(q.to(dtype))
        return v.to(dtype), lam_v, k, q

    def check_input(self, x: Any, ndim: int, name: str) -> None:
        """``ValueError`` naming ``name`` unless ``x`` is ``(B, L, D)`` (``ndim`` 3) or ``(B, D)``."""
        if x.ndim != ndim or x.shape[-1] != self.d_model:
            want = "(B, L, D)" if ndim == 3 else "(B, D)"
            raise ValueError(f"{name} must have shape {want} with D = {self.d_model}, "
                             f"got {tuple(x.shape)}")

    def read_out(self, y: torch.Tensor, y_var: torch.Tensor | None, z: torch.Tensor, gate: torch.Tensor,
                 return_variance: bool) -> tuple[torch.Tensor, ...]:
        """The block's output from the scan's ``y, y_var`` (B, L, M): ``out_proj((y + D_skip z)
        SiLU(gate))``, and with ``return_variance`` the variance through the squared gate and
        weights (``y_var`` is read only then, and may be ``None`` otherwise). Returns a tuple:
        ``(out,)`` or ``(out, out_var)``."""
        g = F.silu(gate)
        out = self.out_proj((y.to(z.dtype) + self.skip.to(z.dtype) * z) * g)
        if not return_variance:
            return (out,)
        return out, self.output_variance(y_var, gate)

    def output_variance(self, y_var: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``y_var`` (..., M) through the squared gate and output weights: (..., D) in ``y_var``'s dtype."""
        with torch.autocast(y_var.device.type, enabled=False):
            g2 = F.silu(gate).to(y_var.dtype).square()
            return F.linear(y_var * g2, self.out_proj.weight.to(y_var.dtype).square())

    noise_free: bool = False
    """Set true when the process noise is fixed at 0 (``sigma = 0``, frozen): known on the host,
    so the forward runs the filters in mean form, exact at every length, without reading a value."""

    def forward(self, x: torch.Tensor, state: KLAState | None = None, return_variance: bool = False,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor | tuple[Any, ...]:
        """Run the block over a whole sequence (or a chunk of one, continuing ``state``).

        x: (B, L, D). Returns ``y`` (B, L, D); ``(y, y_var)`` with ``return_variance``; and, when a
        ``state`` is given, the new state appended: ``(y, state)`` or ``(y, y_var, state)``.

        ``cu_seqlens``: packed documents (fla's convention, :mod:`kalmanscan.ops.kla.documents`):
        ``x`` is ``(1, total, D)``, int32 offsets ``(N + 1,)``; each document's output is what it
        would get alone (the conv and the filters restart at its first token). A ``state`` then has
        one row per document (``init_state(N)``, or a previous packed call's): each document
        continues its own row, and the new state holds each document's state after its last token
        (an empty document's is its own), as one call per document with its row would give.
        Its values are not read here (no synchronisation): the caller gives valid offsets
        (:meth:`kalmanscan.nn.SequenceModel.forward` checks them once).

        The parameters are valid by construction, so the scan runs unchecked
        (:func:`kalmanscan.ops.kla.kla_scan_unchecked`): no device-to-host synchronisation in the
        forward or the backward, and ``torch.compile`` traces the block whole. Without
        ``return_variance`` the scan leaves ``y_var`` out (on the triton backend its arithmetic and
        memory traffic are saved in the forward and the backward). On the triton
        backend the kernels take ``noise + NOISE_FLOOR`` (:data:`kalmanscan.ops.kla.NOISE_FLOOR`,
        1e-15: below float32's rounding of any noise above 1e-8), which keeps their precision in
        range whatever the noise learns; with :attr:`noise_free` the filters run in mean form on
        the torch backend instead.

        ``y_var`` (B, L, D, float32) is the paper's propagated output variance and is an
        approximation: it treats the scan outputs of different channels as independent given the
        inputs, the gate and skip as deterministic, and maps ``y_var * SiLU(gate)^2`` through the
        squared output weights; it ignores the projections' own uncertainty.
        """
        runner = None if torch.compiler.is_compiling() else _FORWARD.get()
        if runner is not None and id(self) in runner[0]:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: packed documents are not taken by a forward_with runner")
            return runner[1](self, x, state, return_variance)
        self.check_input(x, 3, "x")
        if cu_seqlens is not None:
            documents = check_cu_seqlens(cu_seqlens, x)
            if state is not None and (state.var.shape[0] != documents or state.conv.shape[0] != documents):
                raise ValueError(f"state: packed documents take one state row per document, {documents} "
                                 f"(cu_seqlens), got {state.var.shape[0]}")
        z, gate, window, (v, lam_v, k, q) = self.observe(x, None if state is None else state.conv, cu_seqlens)
        decay, noise = self.discretized()
        initial = None if state is None else FilterState.from_moments(state.var, state.mu)
        with torch.autocast(x.device.type, enabled=False):
            y, y_var, final = kla_scan_unchecked(v, lam_v, k, q, decay.to(lam_v.dtype), noise.to(lam_v.dtype),
                                                 initial_state=initial, return_state=True,
                                                 backend=self.backend, noise_free=self.noise_free,
                                                 variance=return_variance, cu_seqlens=cu_seqlens)
        out = self.read_out(y, y_var, z, gate, return_variance)
        if state is not None:
            out = out + (KLAState(window, final.var, final.mu),)
        return out if len(out) > 1 else out[0]

    def step(self, x_t: torch.Tensor, state: KLAState, return_variance: bool = False, *,
             out: KLAState | None = None) -> tuple[Any, ...]:
        """Advance by one token in O(M S) work: x_t (B, D) -> ``(y_t, state)`` (or ``(y_t, y_var_t,
        state)``), y_t (B, D).

        The same predict-then-update as the scan for one token, in mean form (variance and mean,
        finite without process noise): ``in_proj``, the conv step, ``sensor_proj`` and
        ``out_proj`` as matrix products around the fused conv and filter steps of
        :mod:`kalmanscan.ops.kla.step` (two Triton kernels on CUDA, and with ``backend="triton"``;
        torch operations elsewhere, and wherever autograd records the step, which is then
        differentiable).

        ``out``: a :class:`KLAState` whose tensors receive the new state (``out=state`` advances the
        state in place); they must be contiguous, in the state's dtypes (a state returned by the
        forward may hold views: make it contiguous first, as
        :meth:`~kalmanscan.nn.SequenceModel.generate` does). With it
        the step allocates no state, reads nothing on the host and can be captured in a CUDA
        graph; it records no gradient (a ``ValueError`` where autograd would). Without it the
        returned state is new and ``state`` is left as it was.

        ``decay`` and ``noise`` are computed once per version of the OU parameters when no
        gradient is recorded (:meth:`step_params`).
        """
        self.check_input(x_t, 2, "x_t")
        recording = torch.is_grad_enabled() and (x_t.requires_grad or any(p.requires_grad for p in self.parameters()))
        if out is not None and recording:
            raise ValueError("out: a step into given buffers records no gradient; call it under torch.no_grad()")
        M = self.d_inner
        z_pre, gate = self.in_proj(x_t).split([M, M], -1)
        backend = "torch" if recording else "triton" if self.backend == "triton" else "auto"
        z, window = conv_step(z_pre, state.conv, self.conv.weight[:, 0], self.conv.bias,
                              window_out=None if out is None else out.conv, backend=backend)
        v, log_var, k, q = self.sensor_rows(z)
        decay, noise = self.discretized() if recording else self.step_params()
        dtype = state.var.dtype
        with torch.autocast(x_t.device.type, enabled=False):
            gated, y_var, var, mu = kla_decode_step(
                v, log_var, k, q, z, gate, decay.to(dtype), noise.to(dtype), self.skip, self.obs_var_bias,
                state.var, state.mu, floor=_OBS_VAR_FLOOR, variance=return_variance,
                var_out=None if out is None else out.var, mu_out=None if out is None else out.mu, backend=backend)
        y = self.out_proj(gated)
        new = KLAState(window, var, mu)
        return (y, self.output_variance(y_var, gate), new) if return_variance else (y, new)

    def sensor_rows(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """z (B, M) -> the raw sensor rows ``v, log_var`` (B, M) and ``k, q`` (B, S) of one token,
        before :meth:`sensors`' post-processing (``obs_var_bias`` not added, ``k``, ``q`` not
        normalised): column slices of the sensor projection's output."""
        M, S, r = self.d_inner, self.d_state, self.var_rank
        if self.variant == "plain":
            return self.sensor_proj(z).split([M, M, S, S], -1)
        low, k, q = self.sensor_proj(z).split([r, S, S], -1)
        return z, self.var_expand(low), k, q

    def step_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(decay, noise)`` of :meth:`discretized` without gradient, remembered while the OU
        parameters keep their storage and version (an in-place update, e.g. an optimiser's step or
        a ``fill_`` under ``torch.no_grad()``, recomputes them; a write through ``.data`` is not
        seen): decoding launches no kernel for them."""
        key = tuple((p.data_ptr(), p.dtype, p._version) for p in (self.log_theta, self.noise_parameter(), self.log_dt))
        cached = self.__dict__.get("_step_params")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, *self.discretized())
            self.__dict__["_step_params"] = cached
        return cached[1], cached[2]
