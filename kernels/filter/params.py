"""Static parameters checked and derived in one launch: what :func:`kalmanscan.problem.prepare.prepare` does
with torch operations (about seventy launches), done by one program for parameters given as device
tensors (:mod:`kalmanscan.ops.filter.triton.param_rows`).

The program reads the ``(8, C)`` block of rows ``theta, sigma, obs_var, mean, h, dt, init_mean,
init_var`` (the last two only where given), computes in float64 and writes, in the block's dtype,
the rows ``init_var`` (as used: ``sigma^2 / (2 theta)`` where not given),
``decay, noise`` (:func:`kalmanscan.kernels.filter.steps.ou_transition`, as
:func:`kalmanscan.model.ou.discretize`) and ``lam0 = 1 / init_var``, ``eta0 = lam0 (init_mean - mean)``,
and :data:`NFLAGS` flags (1 = holds), in this order: each of the six parameters finite and
within its bound (the constants ``B_THETA .. B_DT``, from the bounds table
:func:`kalmanscan.problem.bounds.kernel_codes`: 0 finite, 1 ``>= 0``, 2 ``> 0``), ``init_mean``
finite, ``init_var > 0`` (NaN fails), ``theta != 0`` and ``sigma != 0 or theta = 0`` wherever
``init_var`` is not given (the stationary law exists and is not a point), a diffuse prior
somewhere (``init_var = inf``), a decaying channel whose noise is below ``bound``
(:func:`kalmanscan.model.mobius.lacks_noise`), the stationary variance finite in the rows' dtype
wherever it is ``init_var``'s default and ``theta > 0``, and the noise finite in the rows' dtype.

``bound`` is a compile-time constant: a float argument is passed to a compiled kernel as float32,
where float64's bound (1e-290) is 0; as a constant it keeps float64 where float32 cannot hold it.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.filter.steps import ou_transition

NFLAGS = tl.constexpr(14)


@triton.jit
def within(x, CODE: tl.constexpr):
    """``x`` finite and within the bound of code ``CODE`` (0 none, 1 ``>= 0``, 2 ``> 0``), as int32."""
    ok = tl.abs(x) < float("inf")
    if CODE == 1:
        ok = ok & (x >= 0)
    if CODE == 2:
        ok = ok & (x > 0)
    return ok.to(tl.int32)


@triton.jit
def param_rows_kernel(p_ptr, rows_ptr, flags_ptr, C, bound: tl.constexpr,
                      B_THETA: tl.constexpr, B_SIGMA: tl.constexpr, B_OBS: tl.constexpr, B_MEAN: tl.constexpr,
                      B_H: tl.constexpr, B_DT: tl.constexpr,
                      GIVEN_MEAN: tl.constexpr, GIVEN_VAR: tl.constexpr, BLOCK: tl.constexpr):
    """One program over ``C`` in blocks of ``BLOCK`` channels: ``p`` is ``(8, C)``, ``rows``
    ``(5, C)`` (``init_var, decay, noise, lam0, eta0``), ``flags`` ``(NFLAGS,)`` bool or int8 (1 = holds)."""
    one = tl.full([BLOCK], 1, tl.int32)
    f_theta, f_sigma, f_obs, f_mean, f_h, f_dt = one, one, one, one, one, one
    f_m0, f_v0, f_nz, f_pt, diffuse = one, one, one, one, one * 0
    f_sv, f_q = one, one
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
        f_theta = tl.minimum(f_theta, within(theta, B_THETA))
        f_sigma = tl.minimum(f_sigma, within(sigma, B_SIGMA))
        f_obs = tl.minimum(f_obs, within(obs_var, B_OBS))
        f_mean = tl.minimum(f_mean, within(mean, B_MEAN))
        f_h = tl.minimum(f_h, within(h, B_H))
        f_dt = tl.minimum(f_dt, within(dt, B_DT))
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
        if not GIVEN_VAR:
            f_sv = tl.minimum(f_sv, ((v0 < float("inf")) | (theta == 0) | ~ok).to(tl.int32))
        f_q = tl.minimum(f_q, ((noise.to(dtype).to(tl.float64) < float("inf")) | ~ok).to(tl.int32))
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
    tl.store(flags_ptr + 12, tl.min(f_sv, 0).to(tl.int8))
    tl.store(flags_ptr + 13, tl.min(f_q, 0).to(tl.int8))
