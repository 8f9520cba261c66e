"""Time-parallel backward of the filter for few, long series: lanes along time, in reverse.

The backward walks of :mod:`kalmanscan.kernels.filter.bwd` give each lane one (stretch, channel) pair; with
one channel each thread reads its own cache line. Here, as in the forward tiles of
:mod:`kalmanscan.kernels.filter.tiles`, a program owns one series' stretch of ``R`` tiles of ``TILE``
consecutive steps, visited last to first, carrying the adjoints ``(gl, ge)`` of ``(lam, eta)``.
A tile is a block ``[NT, ROW]`` of steps whose *rows* are taken in reverse: block row ``i`` holds
the ``ROW`` consecutive steps of the tile's row ``NT - 1 - i`` (columns in time order), so a
forward inclusive ``tl.associative_scan`` over block rows runs from the tile's last row to its
first (the order the forward kernels' scans use on the GPU; no ``reverse=True`` needed).

One adjoint step is the affine map ``(gl, ge) -> (gl', ge')`` of
:func:`kalmanscan.kernels.filter.bwd.adjoint_step` (upper-triangular matrix: the five numbers
``(g11, g12, g22, v1, v2)`` of :func:`kalmanscan.kernels.filter.bwd.compose5`). Each lane composes its
row's map in registers, walking the row's steps from last to first as
:func:`kalmanscan.kernels.filter.bwd.filter_bwd_agg_kernel` walks a stretch; only the ``NT`` row maps are
combined across lanes.

1. :func:`filter_tile_bwd_agg_kernel` writes each stretch's map ``agg[b, k, s, c]`` (the walk
   backward's format);
2. :func:`kalmanscan.kernels.filter.bwd.filter_bwd_carry_kernel` scans them into the adjoints entering each
   stretch from above, ``top[b, 0/1, s, c]``;
3. :func:`filter_tile_bwd_kernel` scans, in every tile, the row maps, applies them to the
   adjoints entering the tile (from the next tile, or ``top``) for the adjoints after each row,
   moves them one block row on (``tl.gather``: the adjoints entering row ``k`` are those leaving
   row ``k + 1``; the tile's for its last row), walks each row backwards from there with
   :func:`kalmanscan.kernels.filter.bwd.adjoint_step` and writes the tile's gradients as a block; the
   adjoints leaving the tile's first row enter the tile before it.

The state before and after each step is read back from the forward's saved ``mu, lam`` (the
initial state before step 0), as the walks read it. Past ``T`` a step is the identity
(``decay = 1``, ``noise = 0``, zero cotangents): the map is then exactly the identity. Within a
row the numerics are those of the walks; across rows the maps are composed in tree order (the
products of non-negative factors ``g11, g22`` cannot cancel; ``g12, v`` are sums as in a walk).
"""

import triton
import triton.language as tl

from kalmanscan.kernels.filter.bwd import adjoint_step, compose5, emit_gradients
from kalmanscan.kernels.filter.steps import index, pick
from kalmanscan.kernels.filter.tiles import join_columns, row_columns, stretch_setup, tile_inputs


@triton.jit
def last5(g11, g12, g22, v1, v2, last):
    """The 5 numbers of a map at the block row where ``last`` is on, as scalars."""
    return pick(g11, last), pick(g12, last), pick(g22, last), pick(v1, last), pick(v2, last)


@triton.jit
def reversed_columns(x, ROW: tl.constexpr):
    """The ``ROW`` columns of the block ``x`` (``[NT, ROW]``) as a tuple of ``[NT]`` vectors, last
    column first (:func:`kalmanscan.kernels.filter.tiles.row_columns` reversed): the order a row is walked."""
    cols = row_columns(x, ROW)
    out = ()
    for j in tl.static_range(ROW):
        out = (cols[j],) + out
    return out


@triton.jit
def cotangent_columns(g_ptr, o, valid, HAS: tl.constexpr, ROW: tl.constexpr):
    """The cotangent ``g[o]`` of a block ``[NT, ROW]`` (0 where ``valid`` is off) as a tuple of
    ``ROW`` columns ``[NT]``, last first (:func:`reversed_columns`); not read when ``HAS`` is
    off (columns of zeros, which :func:`kalmanscan.kernels.filter.bwd.adjoint_step` then ignores)."""
    if HAS:
        cols = reversed_columns(tl.load(g_ptr + o, mask=valid, other=0.0), ROW)
    else:
        zero = tl.zeros([o.shape[0]], g_ptr.dtype.element_ty)
        cols = ()
        for j in tl.static_range(ROW):
            cols = cols + (zero,)
    return cols


@triton.jit
def tile_adjoint_scan(t, T, b, c, o, C, y_ptr, sy_b, sy_t, sy_c, params, statics,
                      mu_ptr, lam_ptr, lam0, mu0, g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr,
                      TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
                      HAS_G_MU: tl.constexpr, HAS_G_LAM: tl.constexpr, HAS_G_PM: tl.constexpr,
                      HAS_G_PV: tl.constexpr, ROW: tl.constexpr):
    """Everything the reverse steps of the block ``t`` (``[NT, ROW]``, at offsets ``o`` of the
    ``(B, T, C)`` arrays) need, and the scan of its row maps: ``(valid, observed, yc, hr, x, g,
    maps)`` (``params``, ``statics``: the parameters' pointers and strides and the stretch's static
    parameters, as :func:`kalmanscan.kernels.filter.tiles.tile_inputs` takes them) with
    ``hr = h / obs_var`` (:func:`kalmanscan.kernels.filter.steps.observation`; a scalar when
    static), ``x`` the columns, last
    first (:func:`reversed_columns`), of ``(lam_t, mu_t, lam_{t-1}, mu_{t-1}, decay, noise, t)``
    (the saved states after and before each step, the initial ``(lam0, mu0)`` before step 0;
    ``(1, 0)`` past ``T``) and ``g`` those of the cotangents ``(g_mu, g_lam, g_pm, g_pv)``
    (:func:`cotangent_columns`); ``maps`` is the inclusive scan of the :func:`row_adjoint_maps`
    over the block rows, tile's last row first: at block row ``i`` the map from the adjoints after
    the tile to those before its row ``NT - 1 - i`` (5 vectors ``[NT]``)."""
    valid, decay, noise, observed, yc, phi, info, obs_var, mean, h = tile_inputs(
        t, T, b, c, y_ptr, sy_b, sy_t, sy_c, params, statics, TRANS_STEP, OBS_STEP)
    lam = tl.load(lam_ptr + o, mask=valid, other=1.0)
    mu = tl.load(mu_ptr + o, mask=valid, other=0.0)
    prev = valid & (t > 0)
    lam_p = tl.where(prev, tl.load(lam_ptr + o - C, mask=prev, other=1.0), lam0)
    mu_p = tl.where(prev, tl.load(mu_ptr + o - C, mask=prev, other=0.0), mu0)
    x = (reversed_columns(lam, ROW), reversed_columns(mu, ROW), reversed_columns(lam_p, ROW),
         reversed_columns(mu_p, ROW), reversed_columns(decay, ROW), reversed_columns(noise, ROW),
         reversed_columns(t, ROW))
    g = (cotangent_columns(g_mu_ptr, o, valid, HAS_G_MU, ROW), cotangent_columns(g_lam_ptr, o, valid, HAS_G_LAM, ROW),
         cotangent_columns(g_pm_ptr, o, valid, HAS_G_PM, ROW), cotangent_columns(g_pv_ptr, o, valid, HAS_G_PV, ROW))
    maps = tl.associative_scan(row_adjoint_maps(x, g, HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV, ROW), 0, compose5)
    return valid, observed, yc, h / obs_var, x, g, maps


@triton.jit
def stretch_backward_setup(T, C, R, init_ptr, params, TILE: tl.constexpr, ROW: tl.constexpr, WIDE: tl.constexpr):
    """``(s, b, c, t0, statics, lam0, mu0, out, rows, steps)``: the stretch of
    :func:`kalmanscan.kernels.filter.tiles.stretch_setup` (``statics`` its five static parameters), the
    series' initial state ``(lam0, mu0)`` from ``init[b, 0/1, c] = (lam0, lam0 mu0)``, its offset
    ``out = b T C + c``, the block rows ``0 .. NT - 1`` and the steps of the block ``[NT, ROW]``
    within a tile (rows reversed: block row ``i`` holds the tile's row ``NT - 1 - i``)."""
    tl.static_assert(TILE % ROW == 0)
    s, b, c, t0, statics = stretch_setup(T, C, R, params, TILE, WIDE)
    lam0 = tl.load(init_ptr + b * 2 * C + c)
    rows = tl.arange(0, TILE // ROW)
    starts = (TILE // ROW - 1 - rows) * ROW
    return (s, b, c, t0, statics, lam0,
            tl.load(init_ptr + b * 2 * C + C + c) / lam0, b * T * C + c, rows,
            starts[:, None] + tl.arange(0, ROW)[None, :])


@triton.jit
def row_adjoint_maps(x, g, HAS_G_MU: tl.constexpr, HAS_G_LAM: tl.constexpr,
                     HAS_G_PM: tl.constexpr, HAS_G_PV: tl.constexpr, ROW: tl.constexpr):
    """The reverse adjoint map of each block row (vectors ``[NT]``, 5 numbers): from the adjoints of
    the state after the row's last step to those of the state before its first, composed in-thread
    from the last column to the first as :func:`kalmanscan.kernels.filter.bwd.filter_bwd_agg_kernel` walks a
    stretch (``G`` by each step's matrix, ``v`` by the whole step). ``x, g`` are the columns, last
    first, of :func:`tile_adjoint_scan`."""
    lam, mu, lam_p, mu_p, decay, noise, t = x
    g_mu, g_lam, g_pm, g_pv = g
    g22 = tl.full(lam[0].shape, 1.0, lam[0].dtype)
    g11 = g22
    g12 = g22 * 0.0
    v1 = g12
    v2 = g12
    for k in tl.static_range(ROW):
        _, _, v1, v2, _, _, alpha, beta, delta = adjoint_step(
            v1, v2, lam[k], mu[k], lam_p[k], mu_p[k], decay[k], noise[k], t[k], 0, True,
            g_mu[k], g_lam[k], g_pm[k], g_pv[k], HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV, False)
        g12 = alpha * g12 + beta * g22
        g11 = alpha * g11
        g22 = delta * g22
    return g11, g12, g22, v1, v2


@triton.jit
def filter_tile_bwd_agg_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    mu_ptr, lam_ptr, init_ptr, g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr, agg_ptr, T, C, NS, R,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    HAS_G_MU: tl.constexpr, HAS_G_LAM: tl.constexpr, HAS_G_PM: tl.constexpr, HAS_G_PV: tl.constexpr,
    TILE: tl.constexpr, ROW: tl.constexpr, WIDE: tl.constexpr,
):
    """Stretch ``program_id(0)`` of series ``program_id(1) = b C + c``: its reverse adjoint map
    (5 numbers) into ``agg[b, k, s, c]``, as :func:`kalmanscan.kernels.filter.bwd.filter_bwd_agg_kernel`
    writes a stretch's. Cotangents as in :func:`filter_tile_bwd_kernel`."""
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    s, b, c, t0, statics, lam0, mu0, out, rows, steps = stretch_backward_setup(
        T, C, R, init_ptr, params, TILE, ROW, WIDE)
    NT: tl.constexpr = TILE // ROW
    last = rows == NT - 1
    zero = tl.zeros([], lam0.dtype)
    a11, a12, a22, av1, av2 = zero + 1.0, zero, zero + 1.0, zero, zero
    for k in range(R):
        tt = t0 + (R - 1 - k) * TILE
        t = tt + steps
        valid, observed, yc, hr, x, g, adjoint = tile_adjoint_scan(
            t, T, b, c, out + t * C, C, y_ptr, sy_b, sy_t, sy_c, params, statics, mu_ptr, lam_ptr, lam0, mu0,
            g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr,
            TRANS_STEP, OBS_STEP, HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV, ROW)
        g11, g12, g22, v1, v2 = adjoint
        b11, b12, b22, bv1, bv2 = last5(g11, g12, g22, v1, v2, last)
        a11, a12, a22, av1, av2 = compose5(a11, a12, a22, av1, av2, b11, b12, b22, bv1, bv2)
    base = agg_ptr + b * 5 * NS * C + s * C + c
    stride = NS * C
    tl.store(base, a11)
    tl.store(base + stride, a12)
    tl.store(base + 2 * stride, a22)
    tl.store(base + 3 * stride, av1)
    tl.store(base + 4 * stride, av2)


@triton.jit
def filter_tile_bwd_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    mu_ptr, lam_ptr, init_ptr, g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr, top_ptr,
    grad_y_ptr, obs_grad_ptr, trans_grad_ptr, sums_ptr, grad_init_ptr,
    B, T, C, NS, R,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    HAS_G_MU: tl.constexpr, HAS_G_LAM: tl.constexpr, HAS_G_PM: tl.constexpr, HAS_G_PV: tl.constexpr,
    TILE: tl.constexpr, ROW: tl.constexpr, WIDE: tl.constexpr,
):
    """Stretch ``program_id(0)`` of series ``program_id(1) = b C + c`` backwards from its adjoints
    ``top[b, 0/1, s, c]``, a tile at a time: the adjoints entering every row (scan of the row
    maps), then each row walked backwards, then the tile's gradients as blocks.

    Arrays and outputs are those of :func:`kalmanscan.kernels.filter.bwd.filter_bwd_kernel` with the tile
    stretches: cotangents ``(B, T, C)``, read only when their ``HAS_G_*`` flag is on;
    ``grad_y[b, t, c]``; observation adjoints per step to ``obs_grad[k, b, t, c]`` when
    ``OBS_STEP``, else summed over the stretch to ``sums[b, k, s, c]`` (k = 0, 1, 2; each step's
    term added to its own slot of an ``[NT, ROW]`` block over the tiles, the block summed at the
    end); transition adjoints per step to ``trans_grad[k, b, t, c]`` when ``TRANS_STEP``, else to
    ``sums[b, 3 + k, s, c]``; stretch 0 writes ``grad_init[b, 0/1, c]``.
    """
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    s, b, c, t0, statics, lam0, mu0, out, rows, steps = stretch_backward_setup(
        T, C, R, init_ptr, params, TILE, ROW, WIDE)
    NT: tl.constexpr = TILE // ROW
    tbase = top_ptr + b * 2 * NS * C + s * C + c
    gl = tl.load(tbase)
    ge = tl.load(tbase + NS * C)
    TC = index(B, WIDE) * T * C
    first = rows == 0
    last = rows == NT - 1
    before = tl.maximum(rows - 1, 0)
    zero = tl.zeros([NT, ROW], lam0.dtype)
    s_phi, s_info, s_info_yc, s_decay, s_noise = zero, zero, zero, zero, zero
    for k in range(R):
        tt = t0 + (R - 1 - k) * TILE
        t = tt + steps
        o = out + t * C
        valid, observed, yc, hr, x, g, adjoint = tile_adjoint_scan(
            t, T, b, c, o, C, y_ptr, sy_b, sy_t, sy_c, params, statics, mu_ptr, lam_ptr, lam0, mu0,
            g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr,
            TRANS_STEP, OBS_STEP, HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV, ROW)
        g11, g12, g22, v1, v2 = adjoint
        gl_r = tl.where(first, gl, tl.gather(g11 * gl + g12 * ge + v1, before, 0))
        ge_r = tl.where(first, ge, tl.gather(g22 * ge + v2, before, 0))
        lam, mu, lam_p, mu_p, decay, noise, t_cols = x
        g_mu, g_lam, g_pm, g_pv = g
        tots_l = ()
        tots_e = ()
        d_decays = ()
        d_noises = ()
        for j in tl.static_range(ROW):
            tot_l, tot_e, gl_r, ge_r, d_decay, d_noise, _, _, _ = adjoint_step(
                gl_r, ge_r, lam[j], mu[j], lam_p[j], mu_p[j], decay[j], noise[j], t_cols[j], 0, True,
                g_mu[j], g_lam[j], g_pm[j], g_pv[j], HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV, False)
            tots_l = (tot_l,) + tots_l
            tots_e = (tot_e,) + tots_e
            d_decays = (d_decay,) + d_decays
            d_noises = (d_noise,) + d_noises
        s_phi, s_info, s_info_yc, s_decay, s_noise = emit_gradients(
            join_columns(tots_l, ROW), join_columns(tots_e, ROW), join_columns(d_decays, ROW),
            join_columns(d_noises, ROW), observed, yc, hr, o, valid, TC, grad_y_ptr, obs_grad_ptr,
            trans_grad_ptr, s_phi, s_info, s_info_yc, s_decay, s_noise, TRANS_STEP, OBS_STEP)
        gl = pick(gl_r, last)
        ge = pick(ge_r, last)
    sbase = sums_ptr + b * 5 * NS * C + s * C + c
    stride = NS * C
    if not OBS_STEP:
        tl.store(sbase, tl.sum(tl.sum(s_phi, axis=1), axis=0))
        tl.store(sbase + stride, tl.sum(tl.sum(s_info, axis=1), axis=0))
        tl.store(sbase + 2 * stride, tl.sum(tl.sum(s_info_yc, axis=1), axis=0))
    if not TRANS_STEP:
        tl.store(sbase + 3 * stride, tl.sum(tl.sum(s_decay, axis=1), axis=0))
        tl.store(sbase + 4 * stride, tl.sum(tl.sum(s_noise, axis=1), axis=0))
    tl.store(grad_init_ptr + b * 2 * C + c, gl, mask=s == 0)
    tl.store(grad_init_ptr + b * 2 * C + C + c, ge, mask=s == 0)
