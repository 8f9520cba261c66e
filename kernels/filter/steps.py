"""Per-step building blocks shared by the filter's forward and backward kernels (``@triton.jit``).

Layout shared by every filter kernel. A problem is ``(B, T, C)``; time is cut into ``NS`` stretches
of ``L`` steps. A *lane* is one (stretch ``s``, channel ``c``) pair, numbered ``g = s C + c``
within a batch row, so consecutive lanes are consecutive channels (coalesced loads when ``C`` is
large) and, when ``C`` is small, consecutive stretches. Each lane walks its stretch sequentially in
time: no cross-thread scan inside a stretch. Offsets are 32-bit unless the ``WIDE`` constexpr is on
(the launch wrappers set it for problems of ``2^31`` elements or more): then the batch row and
the time index are 64-bit, and so is every offset formed from them. A parameter is read through its own
``(batch, time, channel)`` strides, so static parameters (time stride 0) and per-step ones share
the kernels; static ones are loaded once per lane when the ``*_STEP`` constexpr flags are off.

Arithmetic is in the dtype of the pointers (float32 in production, float64 in the gradient tests).
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import log, rcp


@triton.jit
def lane_coords(C, NS, BLOCK: tl.constexpr):
    """Lanes of this program: ``(g, lane_ok, s, c)`` for the block ``program_id(0)``."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lane_ok = g < NS * C
    return g, lane_ok, g // C, g % C


@triton.jit
def pick(x, where):
    """The element of the vector ``x`` where the mask ``where`` is on (on at exactly one position),
    as a scalar: a masked sum, since a register vector has no dynamic indexing."""
    return tl.sum(tl.where(where, x, 0.0), axis=0)


@triton.jit
def index(x, WIDE: tl.constexpr):
    """``x`` as an index: 64-bit when ``WIDE`` (arrays of ``2^31`` elements or more), else as is."""
    if WIDE:
        i = tl.cast(x, tl.int64)
    else:
        i = x
    return i


@triton.jit
def load_param(ptr, b, t, c, sb, st, sc, mask, other):
    """``ptr[b, t, c]`` through the strides ``(sb, st, sc)`` (``other`` where ``mask`` is off)."""
    return tl.load(ptr + b * sb + t * st + c * sc, mask=mask, other=other)


@triton.jit
def ou_phi(x):
    """``-expm1(-x) / x`` for ``x >= 0`` (1 at 0), written as Kahan's ``(1 - u) / (-log u)``.

    With ``u = exp(-x)`` rounded, ``(1 - u) / (-log u)`` is accurate to a few ulps for every
    ``x``: the rounding error of ``u`` cancels between numerator and denominator, and ``1 - u`` is
    exact for ``u`` in ``[1/2, 1]``. ``u == 1`` (``x`` below half an ulp) gives 1; above ``x = 50``
    ``exp(-x)`` is negligible and the value is ``1 / x``.
    """
    u = tl.exp(-x)
    one = u == 1.0
    big = x > 50.0
    safe = tl.where(one | big, 0.5, u)
    kahan = (1.0 - safe) / (-tl.log(safe))
    return tl.where(one, 1.0, tl.where(big, 1.0 / tl.where(big, x, 1.0), kahan))


@triton.jit
def ou_transition(theta, sigma, dt):
    """Exact OU discretisation ``decay = exp(-theta dt)``, ``noise = sigma^2 dt phi(2 theta dt)``."""
    x = theta * dt
    return tl.exp(-x), sigma * sigma * dt * ou_phi(2.0 * x)


@triton.jit
def observation(y, obs_var, mean, h):
    """``(observed, yc, hr, phi, info)`` of one observation; NaN ``y`` is missing.

    ``yc = y - h mean`` (centred data, 0 when missing), ``hr = h / obs_var``,
    ``phi = h^2 / obs_var`` and ``info = hr yc`` (both 0 when missing).
    """
    observed = y == y
    yc = tl.where(observed, y - h * mean, 0.0)
    hr = h / obs_var
    return observed, yc, hr, tl.where(observed, hr * h, 0.0), hr * yc


@triton.jit
def load_y(y_ptr, b, t, c, sy_b, sy_t, sy_c, mask):
    """``y[b, t, c]``; NaN (missing) where ``mask`` is off."""
    return load_param(y_ptr, b, t, c, sy_b, sy_t, sy_c, mask, float("nan"))


@triton.jit
def ring_start(y_ptr, b, t0, c, sy_b, sy_t, sy_c, lane_ok, end, fill, PREFETCH: tl.constexpr):
    """``y`` at steps ``t0 .. t0 + 3`` (NaN at or past ``end``): a ring of loads issued ahead.
    Without ``PREFETCH`` no load: four copies of ``fill``, which :func:`walk_y` passes through."""
    if PREFETCH:
        ring = (load_y(y_ptr, b, t0, c, sy_b, sy_t, sy_c, lane_ok & (t0 < end)),
                load_y(y_ptr, b, t0 + 1, c, sy_b, sy_t, sy_c, lane_ok & (t0 + 1 < end)),
                load_y(y_ptr, b, t0 + 2, c, sy_b, sy_t, sy_c, lane_ok & (t0 + 2 < end)),
                load_y(y_ptr, b, t0 + 3, c, sy_b, sy_t, sy_c, lane_ok & (t0 + 3 < end)))
    else:
        ring = (fill, fill, fill, fill)
    return ring


@triton.jit
def ring_next(y_a, y_b, y_c, y_d, y_ptr, b, t, c, sy_b, sy_t, sy_c, lane_ok, end):
    """Step ``t``'s ``y`` out of the ring, and the ring moved on by one (loading step ``t + 4``)."""
    return y_a, y_b, y_c, y_d, load_y(y_ptr, b, t + 4, c, sy_b, sy_t, sy_c, lane_ok & (t + 4 < end))


@triton.jit
def step_inputs(t, valid, b, c, y,
                params, decay_s, noise_s, obs_var_s, mean_s, h_s,
                TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr):
    """Everything step ``t`` needs: ``(decay, noise, observed, yc, hr, phi, info, obs_var, mean, h)``.

    ``params`` are the parameters' 24 pointers and strides in kernel order (``theta_ptr, sth_b,
    sth_t, sth_c, ..., h_ptr, sh_b, sh_t, sh_c``: each kernel packs its arguments into this tuple
    once); ``y`` is the step's observation (loaded by the caller, possibly ahead of time); ``*_s`` are
    the lane's static values (used when the matching ``*_STEP`` flag is off). Step 0
    has no transition: ``decay = 1``, ``noise = 0`` there.
    """
    (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
     obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c) = params
    if TRANS_STEP:
        decay, noise = ou_transition(
            load_param(theta_ptr, b, t, c, sth_b, sth_t, sth_c, valid, 0.0),
            load_param(sigma_ptr, b, t, c, ssg_b, ssg_t, ssg_c, valid, 0.0),
            load_param(dt_ptr, b, t, c, sdt_b, sdt_t, sdt_c, valid, 1.0))
    else:
        decay = decay_s
        noise = noise_s
    first = t == 0
    decay = tl.where(first, 1.0, decay)
    noise = tl.where(first, 0.0, noise)
    if OBS_STEP:
        obs_var = load_param(obs_var_ptr, b, t, c, sov_b, sov_t, sov_c, valid, 1.0)
        mean = load_param(mean_ptr, b, t, c, smn_b, smn_t, smn_c, valid, 0.0)
        h = load_param(h_ptr, b, t, c, sh_b, sh_t, sh_c, valid, 0.0)
    else:
        obs_var = obs_var_s
        mean = mean_s
        h = h_s
    observed, yc, hr, phi, info = observation(y, obs_var, mean, h)
    return decay, noise, observed, yc, hr, phi, info, obs_var, mean, h


@triton.jit
def lane_setup(C, NS, L, params, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Prologue of a walking kernel: ``(b, g, lane_ok, s, c, t0, *statics)``: batch row
    ``program_id(1)``, the program's lanes (:func:`lane_coords`), each lane's first step and its
    static parameters (:func:`static_inputs`)."""
    b = index(tl.program_id(1), WIDE)
    g, lane_ok, s, c = lane_coords(C, NS, BLOCK)
    t0 = index(s, WIDE) * L
    decay_s, noise_s, obs_var_s, mean_s, h_s = static_inputs(t0, lane_ok, b, c, params)
    return b, g, lane_ok, s, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s


@triton.jit
def walk_y(t, lane_ok, end, T, b, c, y_a, y_b, y_c, y_d, y_ptr, sy_b, sy_t, sy_c, PREFETCH: tl.constexpr):
    """A forward walk's step ``t``: ``(valid, y, ring)``, ``y`` out of the ring ``(y_a, .., y_d)``
    of :func:`ring_start` when ``PREFETCH`` (the ring moved on), else loaded now (the ring passed
    through unused)."""
    valid = lane_ok & (t < T)
    if PREFETCH:
        y, y_a, y_b, y_c, y_d = ring_next(y_a, y_b, y_c, y_d, y_ptr, b, t, c, sy_b, sy_t, sy_c, lane_ok, end)
    else:
        y = load_y(y_ptr, b, t, c, sy_b, sy_t, sy_c, valid)
    return valid, y, y_a, y_b, y_c, y_d


@triton.jit
def static_inputs(t0, lane_ok, b, c, params):
    """A lane's parameters at its first step ``t0``: its values for the whole stretch when static.

    ``decay`` and ``noise`` are computed in float64 and rounded to the compute dtype (once per
    lane): the GPU's float32 ``exp`` is about two ulps off, and from a diffuse prior the precision
    grows like ``decay^(-2t)``, which multiplies that error by ``2t`` (docs/math.md §8)."""
    (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
     obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c) = params
    theta = load_param(theta_ptr, b, t0, c, sth_b, sth_t, sth_c, lane_ok, 0.0)
    decay, noise = ou_transition(
        theta.to(tl.float64),
        load_param(sigma_ptr, b, t0, c, ssg_b, ssg_t, ssg_c, lane_ok, 0.0).to(tl.float64),
        load_param(dt_ptr, b, t0, c, sdt_b, sdt_t, sdt_c, lane_ok, 1.0).to(tl.float64))
    decay = decay.to(theta.dtype)
    noise = noise.to(theta.dtype)
    obs_var = load_param(obs_var_ptr, b, t0, c, sov_b, sov_t, sov_c, lane_ok, 1.0)
    mean = load_param(mean_ptr, b, t0, c, smn_b, smn_t, smn_c, lane_ok, 0.0)
    h = load_param(h_ptr, b, t0, c, sh_b, sh_t, sh_c, lane_ok, 0.0)
    return decay, noise, obs_var, mean, h


@triton.jit
def info_step(lam, eta, decay, noise, phi, info):
    """One predict-then-update step of the information filter on ``(lam, eta)`` (docs/math.md §2).

    ``rho = 1 / (decay^2 + noise lam) > 0``; ``lam' = rho lam + phi``,
    ``eta' = decay rho eta + info``. Every term of ``lam'`` is non-negative.
    """
    rho = rcp(decay * decay + noise * lam)
    return rho * lam + phi, decay * rho * eta + info


@triton.jit
def emit_prediction(pred_mu, pred_var, observed, yc, obs_var, mean, h, o, valid, pred_mu_ptr, pred_var_ptr,
                    pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr,
                    POSTERIOR: tl.constexpr):
    """Store the fields of the ``POSTERIOR`` bit mask (:func:`emit_step`) that the prediction
    before a step determines, from its centred mean ``pred_mu`` and variance ``pred_var``:
    ``pred_mean`` (4), ``pred_var`` (8), ``pred_precision`` (32), the predictive law of ``y``
    (64, 128), the log-likelihood (256; 0 where ``y`` is missing) and the missing flag (512).
    Returns the step's log-likelihood with 256 or 1024 set (0 where ``y`` is missing), else zeros:
    bit 1024 computes it for the caller's sum over time without storing it."""
    pred_obs_var = h * h * pred_var + obs_var
    loglik = tl.zeros_like(pred_var)
    if POSTERIOR & 4:
        tl.store(pred_mu_ptr + o, pred_mu + mean, mask=valid)
    if POSTERIOR & 8:
        tl.store(pred_var_ptr + o, pred_var, mask=valid)
    if POSTERIOR & 32:
        tl.store(pred_prec_ptr + o, rcp(pred_var), mask=valid)
    if POSTERIOR & 64:
        tl.store(pred_obs_mean_ptr + o, h * (pred_mu + mean), mask=valid)
    if POSTERIOR & 128:
        tl.store(pred_obs_var_ptr + o, pred_obs_var, mask=valid)
    if POSTERIOR & (256 | 1024):
        innov = yc - h * pred_mu
        loglik = -0.5 * (1.8378770664093453 + log(pred_obs_var) + innov * innov * rcp(pred_obs_var))
        loglik = tl.where(observed, loglik, 0.0)
        if POSTERIOR & 256:
            tl.store(loglik_ptr + o, loglik, mask=valid)
    if POSTERIOR & 512:
        tl.store(missing_ptr + o, tl.where(observed, 0.0, 1.0), mask=valid)
    return loglik


@triton.jit
def emit_step(lam, eta, decay, noise, observed, yc, phi, info, obs_var, mean, h, o, valid,
              mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
              pred_obs_var_ptr, loglik_ptr, missing_ptr,
              WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr,
              POSTERIOR: tl.constexpr):
    """Write step ``t``'s outputs at offset ``o`` from the state ``(lam, eta)`` before it; returns the
    state after it (:func:`info_step`) and the step's log-likelihood (zeros unless the
    ``POSTERIOR`` bit 256 or 1024 is set).

    Centred moments (``POSTERIOR`` off): ``mu = eta / lam`` (filtered centred mean), ``lam``
    (filtered precision), ``pred_mu = decay mu_prev`` and ``pred_var = decay^2 / lam_prev + noise``
    (the prediction before step ``t``; at ``t = 0`` the initial belief), each only if its flag is on.

    With ``POSTERIOR`` (a bit mask of the fields to write, in pointer order: 1 mean, 2 precision,
    4 pred_mean, 8 pred_var, 16 var, 32 pred_precision, 64 pred_obs_mean, 128 pred_obs_var,
    256 logliks, 512 missing, and 1024: the log-likelihood computed, not stored, for a sum over
    time; 0 for the centred moments) the filter result of
    :func:`kalmanscan.ops.filter.torch.finish`, those fields only: ``mu_ptr``
    and ``pred_mu_ptr`` receive the uncentred means ``mu + mean`` and ``pred_mu + mean``,
    ``lam_ptr`` the precision, ``pred_var_ptr`` the predicted variance, and the other pointers
    ``var = 1 / lam``, ``pred_precision = 1 / pred_var``, the predictive law of ``y``
    (``h (pred_mu + mean)``, ``h^2 pred_var + obs_var``), the log-likelihood of ``y`` under it
    (innovation ``yc - h pred_mu`` on the centred state; 0 when missing) and the missing flag
    (1.0 where ``y`` is NaN).
    """
    inv = rcp(lam)
    pred_mu = decay * eta * inv
    pred_var = decay * decay * inv + noise
    loglik = tl.zeros_like(pred_var)
    if POSTERIOR:
        loglik = emit_prediction(pred_mu, pred_var, observed, yc, obs_var, mean, h, o, valid, pred_mu_ptr,
                                 pred_var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr,
                                 missing_ptr, POSTERIOR)
    elif WRITE_PRED:
        tl.store(pred_mu_ptr + o, pred_mu, mask=valid)
        tl.store(pred_var_ptr + o, pred_var, mask=valid)
    lam, eta = info_step(lam, eta, decay, noise, phi, info)
    var = rcp(lam)
    if POSTERIOR:
        if POSTERIOR & 1:
            tl.store(mu_ptr + o, eta * var + mean, mask=valid)
        if POSTERIOR & 16:
            tl.store(var_ptr + o, var, mask=valid)
        if POSTERIOR & 2:
            tl.store(lam_ptr + o, lam, mask=valid)
    else:
        if WRITE_MU:
            tl.store(mu_ptr + o, eta * var, mask=valid)
        if WRITE_LAM:
            tl.store(lam_ptr + o, lam, mask=valid)
    return lam, eta, loglik
