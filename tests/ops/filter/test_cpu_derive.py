"""The cpu backend's derived pass (:mod:`kalmanscan.ops.filter.cpu.derive`): the fields a default
call leaves to the first read, from the vector rows where a task's lanes are adjacent and the
parameters static, the same bits as the per-lane path. Their values against the reference
backend: tests/test_lean_posterior.py."""

import numpy as np
import pytest
from helpers import random_problem

import kalmanscan as ks
from kalmanscan.tuning import tuned


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_derived_rows_equal_per_lane_path_bit_for_bit(dtype):
    """The derived fields (read after a default call) of tasks whose lanes are adjacent, with static
    parameters, come from the pass's vector rows (kalmanscan.ops.filter.cpu.derive.derive_rows);
    the same parameters given per step run its per-lane path: the same bits. 60 channels, so some
    tasks span two batch rows (per-lane there too); an infinite prior variance, a gap across every
    series and a long one in a single series change the cached terms mid-run."""
    rng = np.random.default_rng(23)
    y, kw = random_problem(rng, 400, C=60, missing=0.02)
    y[..., 200:205, :] = np.nan
    y[1, 260:300, 40] = np.nan
    kw["init_var"][0, :5] = np.inf
    y, kw = y.astype(dtype), {k: v.astype(dtype) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    T = y.shape[-2]
    with tuned(numpy_work=0):
        static = ks.filter(y, **kw)
        general = ks.filter(y, **{**kw, "obs_var": np.broadcast_to(kw["obs_var"], (T, 60)).copy()})
        for k in ("precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean", "pred_obs_var",
                  "logliks"):
            np.testing.assert_array_equal(getattr(static, k), getattr(general, k), err_msg=k)
        np.testing.assert_array_equal(static.params["missing"], general.params["missing"])
        assert np.isfinite(static.logliks).all() and np.isfinite(static.pred_obs_var[:, 1:]).all()
