"""Static parameters checked and derived in one launch: what :func:`kalmanscan.problem.prepare.prepare` does
with torch operations (about seventy launches), done by one program for parameters given as device
tensors (:mod:`kalmanscan.ops.filter.triton.param_rows`).

The program reads the ``(8, C)`` block of rows ``theta, sigma, obs_var, mean, h, dt, init_mean,
init_var`` (the last two only where given), computes in float64 and writes, in the block's dtype,
the rows ``init_var`` (as used: ``sigma^2 / (2 theta)`` where not given),
``decay, noise`` (:func:`kalmanscan.kernels.filter.steps.ou_transition`, as
:func:`kalmanscan.model.ou.discretize`) and ``lam0 = 1 / init_var``, ``eta0 = lam0 (init_mean - mean)``,
and :data:`NFLAGS` flags (1 = holds), in this order: each of the six parameters finite and
within its bound (``theta, sigma >= 0``; ``obs_var, dt > 0``), ``init_mean`` finite, ``init_var >
0`` (NaN fails), ``theta != 0`` and ``sigma != 0 or theta = 0`` wherever ``init_var`` is not given
(the stationary law exists and is not a point), a diffuse prior somewhere (``init_var = inf``),
and a decaying channel whose noise is below ``bound`` (:func:`kalmanscan.model.mobius.lacks_noise`).
"""

import triton
import triton.language as tl

from kalmanscan.kernels.filter.steps import ou_transition

NFLAGS = tl.constexpr(12)


@triton.jit
def param_rows_kernel(p_ptr, rows_ptr, flags_ptr, C, bound,
                      GIVEN_MEAN: tl.constexpr, GIVEN_VAR: tl.constexpr, BLOCK: tl.constexpr):
    """One program over ``C`` in blocks of ``BLOCK`` channels: ``p`` is ``(8, C)``, ``rows``
    ``(5, C)`` (``init_var, decay, noise, lam0, eta0``), ``flags`` ``(NFLAGS,)`` int8 (1 = holds)."""
    one = tl.full([BLOCK], 1, tl.int32)
    f_theta, f_sigma, f_obs, f_mean, f_h, f_dt = one, one, one, one, one, one
    f_m0, f_v0, f_nz, f_pt, diffuse = one, one, one, one, one * 0
    smallest = tl.full([BLOCK], 1.0, tl.float64)
    for start in range(0, C, BLOCK):
        c = start + tl.arange(0, BLOCK)
        ok = c < C
        theta = tl.load(p_ptr + c, mask=ok, other=1.0).to(tl.float64)
        sigma = tl.load(p_ptr + C + c, mask=ok, other=1.0).to(tl.float64)
        obs_var = tl.load(p_ptr + 2 * C + c, mask=ok, other=1.0).to(tl.float64)
        mean = tl.load(p_ptr + 3 * C + c, mask=ok, other=0.0).to(tl.float64)
        h = tl.load(p_ptr + 4 * C + c, mask=ok, other=1.0).to(tl.float64)
        dt = tl.load(p_ptr + 5 * C + c, mask=ok, other=1.0).to(tl.float64)
        f_theta = tl.minimum(f_theta, ((tl.abs(theta) < float("inf")) & (theta >= 0)).to(tl.int32))
        f_sigma = tl.minimum(f_sigma, ((tl.abs(sigma) < float("inf")) & (sigma >= 0)).to(tl.int32))
        f_obs = tl.minimum(f_obs, ((obs_var < float("inf")) & (obs_var > 0)).to(tl.int32))
        f_mean = tl.minimum(f_mean, (tl.abs(mean) < float("inf")).to(tl.int32))
        f_h = tl.minimum(f_h, (tl.abs(h) < float("inf")).to(tl.int32))
        f_dt = tl.minimum(f_dt, ((dt < float("inf")) & (dt > 0)).to(tl.int32))
        if GIVEN_MEAN:
            m0 = tl.load(p_ptr + 6 * C + c, mask=ok, other=0.0).to(tl.float64)
            f_m0 = tl.minimum(f_m0, (tl.abs(m0) < float("inf")).to(tl.int32))
        else:
            m0 = mean
        if GIVEN_VAR:
            v0 = tl.load(p_ptr + 7 * C + c, mask=ok, other=1.0).to(tl.float64)
            f_v0 = tl.minimum(f_v0, (v0 > 0).to(tl.int32))
        else:
            f_nz = tl.minimum(f_nz, (theta != 0).to(tl.int32))
            f_pt = tl.minimum(f_pt, ((sigma != 0) | (theta == 0)).to(tl.int32))
            v0 = tl.where(theta == 0, float("inf"), sigma * sigma / (2.0 * tl.where(theta == 0, 1.0, theta)))
        diffuse = tl.maximum(diffuse, (v0 == float("inf")).to(tl.int32))
        decay, noise = ou_transition(theta, sigma, dt)
        smallest = tl.minimum(smallest, tl.where(ok & (decay < 1), noise, 1.0))
        dtype = rows_ptr.dtype.element_ty
        v0 = v0.to(dtype).to(tl.float64)  # the variance as reported; lam0 from it, in float64
        lam0 = 1.0 / tl.where(v0 > 0, v0, 1.0)
        tl.store(rows_ptr + c, v0.to(dtype), mask=ok)
        tl.store(rows_ptr + C + c, decay.to(dtype), mask=ok)
        tl.store(rows_ptr + 2 * C + c, noise.to(dtype), mask=ok)
        tl.store(rows_ptr + 3 * C + c, lam0.to(dtype), mask=ok)
        tl.store(rows_ptr + 4 * C + c, (lam0 * (m0 - mean)).to(dtype), mask=ok)
    flags = (f_theta, f_sigma, f_obs, f_mean, f_h, f_dt, f_m0, f_v0, f_nz, f_pt)
    for i in tl.static_range(10):
        tl.store(flags_ptr + i, tl.min(flags[i], 0).to(tl.int8))
    tl.store(flags_ptr + 10, tl.max(diffuse, 0).to(tl.int8))
    tl.store(flags_ptr + 11, (tl.min(smallest, 0) < bound).to(tl.int8))
