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


def test_remembered_host_parameters_follow_their_values():
    """The checked host rows are remembered by value: an array changed in place between calls,
    a bad value after a good call, and a result changed in place all act as on a first call."""
    from kalmanscan.problem.prepare import prepare

    theta = np.array([0.5, 0.2])
    first = ks.filter(Y, theta=theta, sigma=1.0, obs_var=1.0, backend="torch")
    again = ks.filter(Y, theta=theta, sigma=1.0, obs_var=1.0, backend="torch")
    np.testing.assert_array_equal(first.mean, again.mean)
    theta[1] = 0.9
    changed = ks.filter(Y, theta=theta, sigma=1.0, obs_var=1.0, backend="torch")
    fresh = ks.filter(Y, theta=np.array([0.5, 0.9]), sigma=1.0, obs_var=1.0, backend="torch")
    np.testing.assert_array_equal(changed.mean, fresh.mean)
    assert not np.array_equal(changed.mean, first.mean)
    theta[1] = -1.0
    with pytest.raises(ValueError, match="theta"):
        ks.filter(Y, theta=theta, sigma=1.0, obs_var=1.0, backend="torch")
    p = prepare(torch.as_tensor(Y), theta=0.3, sigma=1.0, obs_var=1.0)
    p.theta.fill_(7.0)
    assert float(prepare(torch.as_tensor(Y), theta=0.3, sigma=1.0, obs_var=1.0).theta[0, 0]) == 0.3
