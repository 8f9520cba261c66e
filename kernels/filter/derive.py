"""The Posterior fields that follow from a filter's filtered mean and variance, in one elementwise
pass (launched by :mod:`kalmanscan.ops.filter.triton.derive`).

With the centred filtered mean ``z_t = mean_t - m_t`` (``m`` the OU mean level) and ``(a_t, q_t)``
the transition into step ``t``, the formulas and the order of operations of
:mod:`kalmanscan.inference.derived` (its torch operations), element by element::

    zp_t = a_t z_{t-1},                   pred_var_t = a_t a_t var_{t-1} + q_t     (t >= 1)
    zp_0 = init_mean - m_0,               pred_var_0 = init_var
    pred_mean = zp + m,   pred_obs_mean = h pred_mean,   S = pred_obs_var = h h pred_var + obs_var
    logliks = -((log(2 pi) + log S) + v v (1 / S)) / 2,   v = (y - h m) - h zp   (0 where y is NaN)
    precision = 1 / var,   pred_precision = 1 / pred_var,   missing = 1 where y is NaN, else 0

Each input is read through its ``(batch, time, channel)`` strides (a static parameter has time
stride 0; ``init_mean`` and ``init_var`` are read at time index 0). Each program owns a tile of
``BLOCK_T`` steps by ``BLOCK_C`` channels of one series batch (channels contiguous): the step
before the tile's first is read again from memory, so tiles are independent. ``FIELDS`` is a bit
mask of the outputs to write, in pointer order (1 precision, 2 pred_mean, 4 pred_var,
8 pred_precision, 16 pred_obs_mean, 32 pred_obs_var, 64 logliks, 128 missing); an input no wanted
field needs is not read. Arithmetic in the outputs' dtype; divisions are ``1.0 / x`` (float32 on
the GPU: ``div.full``, within 2 ulps), so values agree with the torch operations to rounding.
"""

import triton
import triton.language as tl


@triton.jit
def _at(ptr, sb, st, sc, b, t, c, mask, other: tl.constexpr, dtype: tl.constexpr):
    """``x[b, t, c]`` of a strided ``(B, T, C)`` input, in ``dtype``; ``other`` where not ``mask``."""
    return tl.load(ptr + (b * sb + t * st + c * sc), mask=mask, other=other).to(dtype)


@triton.jit
def derive_fields_kernel(
    # inputs with their (batch, time, channel) strides
    y_ptr, y_sb, y_st, y_sc,
    mean_ptr, mean_sb, mean_st, mean_sc,            # filtered mean
    var_ptr, var_sb, var_st, var_sc,                # filtered variance
    level_ptr, level_sb, level_st, level_sc,        # OU mean level m
    h_ptr, h_sb, h_st, h_sc,
    obs_var_ptr, obs_var_sb, obs_var_st, obs_var_sc,
    decay_ptr, decay_sb, decay_st, decay_sc,
    noise_ptr, noise_sb, noise_st, noise_sc,
    init_mean_ptr, init_mean_sb, init_mean_sc,      # (batch, channel) strides: read at t = 0
    init_var_ptr, init_var_sb, init_var_sc,
    # outputs, contiguous (B, T, C), in the order of the FIELDS bits
    precision_ptr, pred_mean_ptr, pred_var_ptr, pred_precision_ptr, pred_obs_mean_ptr, pred_obs_var_ptr,
    logliks_ptr, missing_ptr,
    # dimensions
    T, C,
    # meta-parameters
    FIELDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
):
    """One ``(BLOCK_T, BLOCK_C)`` tile of one batch: see the module docstring."""
    dtype = precision_ptr.dtype.element_ty
    n_t = tl.cdiv(T, BLOCK_T)
    n_c = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0)
    b = pid // (n_t * n_c)
    t = (pid // n_c) % n_t * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    c = pid % n_c * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    if WIDE:
        b, t, c = b.to(tl.int64), t.to(tl.int64), c.to(tl.int64)
    ok = (t < T) & (c < C)
    o = (b * T + t) * C + c
    first = t == 0
    before = ok & (t > 0)  # the step before exists
    if FIELDS & 1:  # precision
        var = _at(var_ptr, var_sb, var_st, var_sc, b, t, c, ok, 1.0, dtype)
        tl.store(precision_ptr + o, 1.0 / var, mask=ok)
    if FIELDS & (64 | 128):  # logliks, missing: y
        y = _at(y_ptr, y_sb, y_st, y_sc, b, t, c, ok, 0.0, dtype)
        missing = y != y
    if FIELDS & (2 | 4 | 8 | 16 | 32 | 64):  # all but precision and missing: the transition
        a = _at(decay_ptr, decay_sb, decay_st, decay_sc, b, t, c, before, 0.0, dtype)
    if FIELDS & (2 | 16 | 32 | 64):  # h
        h = _at(h_ptr, h_sb, h_st, h_sc, b, t, c, ok, 0.0, dtype)
    if FIELDS & (2 | 16 | 64):  # pred_mean, pred_obs_mean, logliks: the predicted mean
        level = _at(level_ptr, level_sb, level_st, level_sc, b, t, c, ok, 0.0, dtype)
        z_prev = (_at(mean_ptr, mean_sb, mean_st, mean_sc, b, t - 1, c, before, 0.0, dtype)
                  - _at(level_ptr, level_sb, level_st, level_sc, b, t - 1, c, before, 0.0, dtype))
        init_mean = tl.load(init_mean_ptr + (b * init_mean_sb + c * init_mean_sc), mask=ok & first,
                            other=0.0).to(dtype)
        zp = tl.where(first, init_mean - level, a * z_prev)
        pred_mean = zp + level
        if FIELDS & 2:  # pred_mean
            tl.store(pred_mean_ptr + o, pred_mean, mask=ok)
        if FIELDS & 16:  # pred_obs_mean
            tl.store(pred_obs_mean_ptr + o, h * pred_mean, mask=ok)
    if FIELDS & (4 | 8 | 32 | 64):  # pred_var, pred_precision, pred_obs_var, logliks: the predicted variance
        var_prev = _at(var_ptr, var_sb, var_st, var_sc, b, t - 1, c, before, 0.0, dtype)
        q = _at(noise_ptr, noise_sb, noise_st, noise_sc, b, t, c, before, 0.0, dtype)
        init_var = tl.load(init_var_ptr + (b * init_var_sb + c * init_var_sc), mask=ok & first,
                           other=1.0).to(dtype)
        pred_var = tl.where(first, init_var, a * a * var_prev + q)
        if FIELDS & 4:  # pred_var
            tl.store(pred_var_ptr + o, pred_var, mask=ok)
        if FIELDS & 8:  # pred_precision
            tl.store(pred_precision_ptr + o, 1.0 / pred_var, mask=ok)
    if FIELDS & (32 | 64):  # pred_obs_var, logliks: the predictive variance of y
        obs_var = _at(obs_var_ptr, obs_var_sb, obs_var_st, obs_var_sc, b, t, c, ok, 1.0, dtype)
        S = h * h * pred_var + obs_var
        if FIELDS & 32:  # pred_obs_var
            tl.store(pred_obs_var_ptr + o, S, mask=ok)
    if FIELDS & 64:  # logliks
        v = (tl.where(missing, 0.0, y) - h * level) - h * zp
        ll = -0.5 * ((1.8378770664093453 + tl.log(S)) + v * v * (1.0 / S))
        tl.store(logliks_ptr + o, tl.where(missing, 0.0, ll), mask=ok)
    if FIELDS & 128:  # missing
        tl.store(missing_ptr + o, tl.where(missing, 1.0, 0.0), mask=ok)
