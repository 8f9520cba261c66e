"""Bad input gets a ValueError naming the argument."""

import numpy as np
import pytest
import torch

import kalmanscan as ks

Y = np.random.default_rng(0).normal(size=(10, 2))
GOOD = dict(theta=0.5, sigma=1.0, obs_var=1.0)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("kwargs, name", [
    (dict(obs_var=0.0), "obs_var"),
    (dict(obs_var=-1.0), "obs_var"),
    (dict(obs_var=np.nan), "obs_var"),
    (dict(sigma=-0.1), "sigma"),
    (dict(theta=-0.1), "theta"),
    (dict(theta=np.inf), "theta"),
    (dict(dt=0.0), "dt"),
    (dict(times=np.array([0.0, 1, 2, 2, 3, 4, 5, 6, 7, 8])), "times"),
    (dict(times=np.arange(10.0)[::-1]), "times"),
    (dict(times=np.arange(9.0)), "times"),
    (dict(theta=np.ones(3)), "theta"),
    (dict(obs_var=np.ones((4, 2))), "obs_var"),
    (dict(h=np.ones((5, 10, 3))), "h"),
    (dict(theta=0.0), "init_var"),
    (dict(init_var=0.0), "init_var"),
    (dict(init_mean=np.ones(5)), "init_mean"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_names_the_argument(kwargs, name, backend):
    kw = dict(GOOD, backend=backend)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=name):
        ks.filter(Y, **kw)


def test_infinite_y_and_bad_shapes():
    y = Y.copy()
    y[3, 1] = np.inf
    with pytest.raises(ValueError, match="y"):
        ks.filter(y, **GOOD)
    with pytest.raises(ValueError, match="y"):
        ks.filter(np.ones(5), **GOOD)
    with pytest.raises(ValueError, match="y"):
        ks.filter(np.array([["a", "b"]]), **GOOD)
    with pytest.raises(ValueError, match="sigma"):
        ks.filter(Y, theta=0.5, sigma=None, obs_var=1.0)


def test_random_walk_with_init_var_is_fine():
    post = ks.filter(torch.tensor(Y), theta=0.0, sigma=1.0, obs_var=1.0, init_var=4.0)
    assert torch.all(torch.isfinite(post.mean))
