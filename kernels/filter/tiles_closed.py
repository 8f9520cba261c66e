"""Complete stretches of one series in closed form: the tiles' fast branch (docs/math.md §9, §10).

With static parameters every observed step applies the same Möbius matrix ``P = [[1 + q phi,
a^2 phi], [q, a^2]]`` to the precision. A *complete* stretch (every ``y`` observed, not the
series' first, no step past ``T``) then needs no scan of seven-number maps:

- its merged map (:mod:`kalmanscan.kernels.filter.fwd`'s seven numbers) is, scaled by
  ``mu1^-L`` (``mu1 = a^2 + q lam*``, the larger eigenvalue), ``P^L / mu1^L = E1 + u_L E2`` with the
  spectral projectors ``E1 = [[x+, -x+ x-], [1, -x-]] / D``, ``E2 = [[-x-, x+ x-], [-1, x+]] / D``
  (``x+ = lam* > 0 > x-`` the fixed points, ``D = x+ - x-``, ``u_k = rho^k``, ``rho = f*^2``),
  the forget factor ``f*^L`` and the information row ``sum_k f*^(L-k) info_k row2(E1 + u_k E2)``
  = ``[sum w_k (1 - u_k) info_k, sum w_k (u_k x+ - x-) info_k] / D``, ``w_k = f*^(L-k)``: two
  weighted sums (:func:`closed_sums`). Every entry of the projectors' combination is a sum of
  non-negative terms, and ``1 - u`` is formed as ``x phi(x)`` (Kahan), so nothing cancels but the
  sums of information, as in a walk.
- its outputs need the precision before each step, which is the power of the map applied to the
  stretch's starting precision: at each row's first step in closed form (:func:`closed_power`, the
  deviation form whose terms are non-negative), then walked through the row's steps in-thread; the
  information mean is then a first-order recurrence ``eta' = f eta + info``, ``f = a / (a^2 + q
  lam)``, scanned over a tile's rows as affine maps (two numbers, :func:`closed_tile_states`).

Constants (:func:`closed_constants`) are computed once per program in float64 from the rounded
``decay`` and ``noise`` the general steps use, so both branches apply the same map.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.filter.steps import ou_phi


@triton.jit
def closed_constants64(decay, noise, obs_var, h):
    """``(xp, xm, f, omf, nlr, c_lam, c_var, usable)`` of the step's Möbius map in float64: the fixed
    points ``x+ = lam*``, ``x-``, the steady forget factor ``f*`` and ``1 - f*`` (from non-negative
    terms), ``-log rho``, the deviation coefficients of :func:`closed_power`, and whether the
    closed form is usable (see :func:`closed_constants`)."""
    a = decay.to(tl.float64)
    q = noise.to(tl.float64)
    phi = (h / obs_var * h).to(tl.float64)  # as the steps form it
    a2 = a * a
    b = (1.0 - a2) + q * phi
    root = b + tl.sqrt(b * b + 4.0 * a2 * q * phi)
    xp = root / (2.0 * tl.where(q > 0, q, 1.0))
    xm = -2.0 * a2 * phi / tl.where(root > 0, root, 1.0)
    mu1 = a2 + q * xp
    f = a / mu1
    omf = (1.0 - a) + a * phi / tl.where(xp > 0, xp, 1.0)  # 1 - f* = (1 - a) + a K: non-negative terms
    omr = omf * (1.0 + f)
    nlr = -2.0 * tl.log(tl.where(f > 0, f, 1.0))  # (decay 0: no closed form, usable is false)
    c_lam = q / (mu1 * omr)
    c_var = phi * a2 / (mu1 * omr)
    inf = float("inf")
    usable = ((q > 0) & (xp > 0) & (xp < inf) & (omf > 0) & (f > 0) & (nlr < inf)
              & (c_lam < inf) & (c_var < inf) & (1.0 / xp < inf))
    return xp, xm, f, omf, nlr, c_lam, c_var, usable


@triton.jit
def closed_constants(decay, noise, obs_var, h):
    """``(xp, xm, inv_d, log2_f, nlr, c_lam, c_var, var_star, usable)`` of one series (scalars of
    the compute dtype; ``usable`` a boolean): the fixed points ``x+ = lam*``, ``x-``, ``1 / D``,
    ``log2 f*``, ``-log rho``, the deviation coefficients of :func:`closed_power` and ``1 / lam*``.
    ``usable`` is false where the map has no attracting fixed point or a constant is out of range
    (no process noise, ``theta = 0`` with ``h = 0``): the general branch runs there."""
    xp, xm, f, omf, nlr, c_lam, c_var, usable = closed_constants64(decay, noise, obs_var, h)
    return rounded_constants(xp, xm, nlr, c_lam, c_var, decay.dtype) + (usable,)


@triton.jit
def rounded_constants(xp, xm, nlr, c_lam, c_var, dtype: tl.constexpr):
    """:func:`closed_constants`' values but ``usable``, rounded once from the float64 ones of
    :func:`closed_constants64` to ``dtype``."""
    return (xp.to(dtype), xm.to(dtype), (1.0 / (xp - xm)).to(dtype), (-0.5 * nlr / 0.6931471805599453).to(dtype),
            nlr.to(dtype), c_lam.to(dtype), c_var.to(dtype), (1.0 / xp).to(dtype))


@triton.jit
def one_minus_power(k, nlr):
    """``(u, 1 - u)`` for ``u = rho^k = exp(-k nlr)``, ``1 - u = x phi(x)`` with ``x = k nlr``:
    accurate where ``rho`` is close to 1 and ``1 - u`` would cancel."""
    x = k * nlr
    return tl.exp(-x), x * ou_phi(x)


@triton.jit
def closed_power(lam0, k, xp, var_star, nlr, c_lam, c_var):
    """The precision after ``k >= 0`` observed steps from ``lam0 > 0``: ``lam* + d u / (1 + c d (1 -
    u))`` with ``d = lam0 - lam* >= 0``, or the same for the variance where ``lam0 < lam*`` (docs/math.md
    §9): every term non-negative."""
    u, omu = one_minus_power(k, nlr)
    above = lam0 >= xp
    d_lam = tl.where(above, lam0 - xp, 0.0)
    d_var = tl.where(above, 0.0, (xp - lam0) / xp / lam0)  # 1 / lam0 - 1 / lam*, no product of precisions
    lam_hi = xp + d_lam * u / (1.0 + c_lam * d_lam * omu)
    var_lo = var_star + d_var * u / (1.0 + c_var * d_var * omu)
    return tl.where(above, lam_hi, 1.0 / var_lo)


@triton.jit
def one_minus_exp(x):
    """``(u, 1 - u)`` for ``u = exp(-x)``, ``x >= 0``, without a division: below ``x = 1/2`` the
    Taylor series of ``1 - exp(-x)`` to degree 8 (truncation below ``x^9 / 9! / (1 - e^-x) < 1.4e-8``
    relative), above it ``1 - u`` itself (relative error at most ``u / (1 - u) < 1.55`` ulps); in
    float64, :func:`one_minus_power`'s division."""
    if x.dtype == tl.float64:  # the series' truncation is not below float64's rounding: Kahan's form
        u, omu = one_minus_power(x, 1.0)
    else:
        u = tl.exp(-x)
        series = x * (1.0 - x * (1.0 / 2 - x * (1.0 / 6 - x * (1.0 / 24 - x * (1.0 / 120 - x * (
            1.0 / 720 - x * (1.0 / 5040 - x * (1.0 / 40320))))))))
        omu = tl.where(x < 0.5, series, 1.0 - u)
    return u, omu


@triton.jit
def closed_weights(j, L, xp, xm, log2_f, nlr):
    """The weights of step ``j`` (0-based) of a complete stretch of ``L`` steps in its information
    row: ``w (1 - u)`` and ``w (u - x- / x+)``, ``w = f*^(L - 1 - j)``, ``u = rho^(j + 1)``. The second
    is the row's ``w (u x+ - x-)`` over ``x+``: dimensionless, so its sum with the information (a
    precision times an information would scale as ``1 / c^3`` with the data's scale ``c``) stays
    in range as far as the information does; :func:`closed_agg7` multiplies ``x+`` back in."""
    w = tl.exp2((L - 1 - j).to(log2_f.dtype) * log2_f)
    u, omu = one_minus_exp((j + 1).to(nlr.dtype) * nlr)
    return w * omu, w * (u - xm / xp)


@triton.jit
def closed_agg7(s1, s2, L, xp, xm, inv_d, log2_f, nlr):
    """The merged map of a complete stretch of ``L`` steps from its weighted sums (trace 1), ``s2``
    over ``x+`` (:func:`closed_weights`). ``x+ / D`` is formed first: a ratio, so no entry passes
    through the product of two precisions ``x+ x-``."""
    u, omu = one_minus_power(L.to(nlr.dtype), nlr)
    scale = inv_d / (1.0 + u)  # the trace of E1 + u E2 is 1 + u
    xp_scale = xp * scale
    f = tl.exp2(L.to(log2_f.dtype) * log2_f) / (1.0 + u)
    return ((xp - u * xm) * scale, -xm * omu * xp_scale, omu * scale, (u * xp - xm) * scale,
            s1 * scale, s2 * xp_scale, f)


@triton.jit
def closed_sums(acc1, acc2, gaps, j, L, observed, info, xp, xm, log2_f, nlr):
    """The terms of :func:`closed_weights`' sums over a tile (steps ``j`` within the stretch, ``[NT,
    ROW]``) added elementwise to ``acc1, acc2``, and its missing values to ``gaps`` (summed over
    the tile by the caller, once per stretch)."""
    w1, w2 = closed_weights(j, L, xp, xm, log2_f, nlr)
    return acc1 + w1 * info, acc2 + w2 * info, gaps + (observed == 0).to(tl.int32)


@triton.jit
def tile_sum(x):
    """The sum of a ``[NT, ROW]`` block."""
    return tl.sum(tl.sum(x, 1), 0)


@triton.jit
def affine_combine(f1, x1, f2, x2):
    """``x -> f2 (f1 x + x1) + x2``: the affine map ``(f2, x2)`` after ``(f1, x1)``."""
    return f2 * f1, f2 * x1 + x2


@triton.jit
def closed_tile_states(lam_rows, eta0, decay, noise, phi, inf, first, before, ROW: tl.constexpr):
    """The states before each step of a complete tile: ``(lams, etas)``, tuples of ``ROW`` columns
    ``[NT]``. ``lam_rows`` is the precision before each row's first step (closed form),
    ``eta0`` the information mean before the tile, ``decay, noise, phi`` the series' scalars and
    ``inf`` the tile's information as columns. Each row walks its precision in-thread and composes
    its affine map of the mean; the maps are scanned over rows and each row's mean walked from the
    one before it."""
    a2 = decay * decay
    lam = lam_rows
    lams = ()
    gates = ()
    F = tl.full(lam_rows.shape, 1.0, lam_rows.dtype)
    Bv = tl.zeros(lam_rows.shape, lam_rows.dtype)
    for j in tl.static_range(ROW):
        lams = lams + (lam,)
        rho = rcp(a2 + noise * lam)
        g = decay * rho
        gates = gates + (g,)
        F = F * g
        Bv = Bv * g + inf[j]
        lam = rho * lam + phi
    F, Bv = tl.associative_scan((F, Bv), 0, affine_combine)
    eta = tl.where(first, eta0, tl.gather(F * eta0 + Bv, before, 0))
    etas = ()
    for j in tl.static_range(ROW):
        etas = etas + (eta,)
        eta = gates[j] * eta + inf[j]
    return lams, etas, eta
