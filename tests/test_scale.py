"""Scale equivariance: every backend right at every scale where the answer is representable.

A Kalman filter is scale-equivariant: with ``y, sigma, mean, init_mean -> c y, c sigma, c mean,
c init_mean`` and ``obs_var, init_var -> c^2 obs_var, c^2 init_var`` (``theta``, ``h``, ``dt``
unchanged) the filtered, predicted and smoothed means scale by ``c``, the variances by ``c^2``, the
precisions by ``c^-2``, and each observed step's log-density shifts by ``-log c``. Each backend at
``c = 10^k`` is compared with the float64 reference at ``c = 1``, scaled: for float64 across
``k`` in -150..150 (the variances ``c^2`` stay normal numbers; past that ``obs_var`` itself
leaves the range), for float32 across -17..17 (the same for float32). Two problems: scalar
parameters (the host's path, the cpu backend's static loop) and a rich one (batch dimension,
per-step ``obs_var`` and ``sigma``, a random-walk channel, a diffuse channel with a leading gap,
missing values, irregular times), smoothed and filtered in one call; a continued stream; the
one-step StreamFilter; each path of the fused kernels; gradients; and the command line. Outputs
are NaN-free and infinite exactly where the reference's are (a diffuse prior's leading steps).
The same tolerances as the rest of the suite (1e-10, and :data:`helpers.FLOAT32_BOUND` for float32).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import FLOAT32_BOUND, device_of, to_np

import kalmanscan as ks
from kalmanscan.cli import main

BACKENDS = ("cpu", "torch", "reference", "triton")
DIFFERENTIABLE = ("cpu", "torch", "triton")
EXPONENTS = (-150, -100, -80, -40, 0, 40, 80, 100, 150)
EXPONENTS_32 = (-17, -12, -6, 0, 6, 12, 17)
TOL = 1e-10
LOCATION = ("y", "sigma", "mean", "init_mean")
SPREAD = ("obs_var", "init_var")
# (field, power of c it scales by): the filter's and the smoother's moments.
FIELDS = (("mean", 1), ("var", 2), ("precision", -2), ("pred_mean", 1), ("pred_var", 2), ("pred_precision", -2),
          ("pred_obs_mean", 1), ("pred_obs_var", 2))


def static_problem():
    """The problem of the report: scalar parameters, default (stationary) prior."""
    y = np.random.default_rng(0).normal(size=(50, 3))
    return dict(y=y, theta=0.1, sigma=0.5, obs_var=1.0)


def rich_problem():
    """Batch 2, T = 23, C = 4: per-step obs_var and sigma, channel 1 a random walk, channel 0
    diffuse with a leading gap, 10% missing values, irregular times."""
    rng = np.random.default_rng(1)
    B, T, C = 2, 23, 4
    y = rng.normal(size=(B, T, C)) * 1.5
    y[rng.random(y.shape) < 0.1] = np.nan
    y[:, :3, 0] = np.nan
    sigma = np.array([0.5, 0.8, 1.1, 0.2]) * rng.uniform(0.7, 1.3, (T, C))
    return dict(y=y, theta=np.array([0.3, 0.0, 1.5, 0.05]), sigma=sigma,
                obs_var=rng.uniform(0.1, 2.0, (B, T, C)), mean=np.array([0.5, -1.0, 2.0, 0.0]),
                h=np.array([1.0, -0.7, 1.3, 2.0]), init_mean=np.array([0.0, 0.3, -0.5, 1.0]),
                init_var=np.array([np.inf, 0.7, 1.3, 2.0]), times=np.cumsum(rng.uniform(0.2, 2.5, T)))


PROBLEMS = {"static": static_problem, "rich": rich_problem}
STEPPED = ("y", "obs_var", "sigma")  # the rich problem's per-step arrays


def scaled(kw: dict, c: float, dtype=np.float64) -> dict:
    """The problem ``kw`` at scale ``c`` (module docstring), arrays of ``dtype``."""
    out = {}
    for k, v in kw.items():
        v = v * c if k in LOCATION else v * (c * c) if k in SPREAD else v
        out[k] = np.asarray(v, dtype=np.float64 if k == "times" else dtype)
    return out


def n_observed(post, y) -> np.ndarray:
    """Observed steps in the log-likelihood per series: the non-missing ones less the diffuse ones."""
    return (~np.isnan(y)).sum(-2) - post.n_diffuse


def check_field(actual, ref, c: float, power: int, tol: float, name: str) -> None:
    """``actual / c^power`` against ``ref``: NaN-free, infinite where ``ref`` is, elsewhere within
    ``tol`` (relative elementwise for positive fields, relative to the largest magnitude for signed)."""
    a, r = to_np(actual), to_np(ref)
    assert not np.isnan(a).any(), f"{name}: NaN"
    assert (np.isinf(a) == np.isinf(r)).all(), f"{name}: infinite where the reference is not (or not where it is)"
    fin = np.isfinite(r)
    a, r = a[fin] / c ** power, r[fin]
    if name.endswith(("var", "precision")):
        err = np.max(np.abs(a - r) / np.maximum(np.abs(r), 1e-300), initial=0.0)
    else:
        err = np.max(np.abs(a - r), initial=0.0) / max(np.max(np.abs(r), initial=0.0), 1e-300)
    assert err < tol, f"{name}: relative error {err:.3g}"


def check_loglik(post, ref, y, c: float, tol: float) -> None:
    """The log-likelihood at scale ``c`` against ``ref``'s shifted by ``-n_obs log c``: within ``tol``
    of the magnitude of its terms."""
    ll = to_np(post.loglik)
    assert np.isfinite(ll).all(), "loglik: not finite"
    shift = n_observed(ref, y) * math.log(c)
    err = np.abs(ll + shift - ref.loglik) / (np.abs(ref.loglik) + np.abs(shift) + 1.0)
    assert err.max() < tol, f"loglik: relative error {err.max():.3g}"
    logliks = to_np(post.logliks)
    assert not np.isnan(logliks).any(), "logliks: NaN"


def check_posterior(post, ref, y, c: float, tol: float, smoothed: bool) -> None:
    """Every moment of ``post`` (and of ``post.filtered`` when ``smoothed``) against ``ref`` scaled."""
    for name, power in FIELDS:
        check_field(getattr(post, name), getattr(ref, name), c, power, tol, name)
    if smoothed:
        for name, power in FIELDS[:3]:
            check_field(getattr(post.filtered, name), getattr(ref.filtered, name), c, power, tol, f"filtered {name}")
    check_loglik(post, ref, y, c, tol)


def reference(problem: str):
    """``(kw, smoothed)``: the problem and the float64 reference smoother's result at ``c = 1``."""
    kw = PROBLEMS[problem]()
    return kw, ks.smooth(backend="reference", **kw)


def smoothed_at(kw: dict, k: int, backend: str, dtype=np.float64):
    """``(c, ys, post)``: ``ks.smooth`` of ``kw`` at ``c = 10^k`` on ``backend`` (the triton backend on
    its kernels' device)."""
    c = 10.0 ** k
    s = scaled(kw, c, dtype)
    if backend == "triton":
        dev = device_of(backend)
        s = {k: v if k == "times" else torch.tensor(v, device=dev) for k, v in s.items()}
    return c, to_np(s["y"]), ks.smooth(backend=backend, **s)


def test_cpu_every_exponent():
    """The cpu backend (the default on the CPU) at every ``k`` in -150..150, both problems."""
    for problem in PROBLEMS:
        kw, ref = reference(problem)
        for k in range(-150, 151):
            c, y, post = smoothed_at(kw, k, "cpu")
            check_posterior(post, ref, y, c, TOL, smoothed=True)


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_sweep(backend, problem):
    """Filter, smoother and log-likelihood of each backend across ``k`` in -150..150."""
    kw, ref = reference(problem)
    exponents = EXPONENTS[::2] if backend == "triton" else EXPONENTS  # the interpreter is slow
    for k in exponents:
        c, y, post = smoothed_at(kw, k, backend)
        check_posterior(post, ref, y, c, TOL, smoothed=True)


# The fused kernels' other paths: several stretches joined through the merged form (their
# aggregates composed, or in closed form for static parameters: two stretches a program, so the
# programs after the first hold complete stretches only), and time-parallel tiles (one channel;
# composed, or in closed form).
KERNEL_PATHS = {"stretches": dict(stretch=8, walk_closed=False),
                "stretches_closed": dict(stretch=5, closed_chunk=5, small_c_block=2),
                "tiles": dict(tile=16, tile_stretches=4, tile_row=4, tile_closed=False),
                "tiles_closed": dict(tile=16, tile_stretches=4, tile_row=4)}


@pytest.mark.parametrize("path", list(KERNEL_PATHS))
def test_kernel_paths_sweep(path):
    """Each path of the fused kernels (filter and smoother, launched with a config that forces it)
    at ``k`` in (-140, 150) against the reference at ``c = 1``, one channel (the tiles' regime), and
    the filter's gradients against its own at ``c = 1``.
    (At ``k = -150`` the process noise, about ``1e-301``, is below
    :data:`kalmanscan.model.mobius.NO_NOISE`: the backend runs the torch filter instead.)"""
    from helpers import config, prepared, triton_filter, triton_smooth

    kw = static_problem()
    kw["y"] = kw["y"][:, :1]
    ref = ks.smooth(backend="reference", **kw)
    cfg = config(**KERNEL_PATHS[path])

    def grads(k):
        """Gradients of a scale-free loss of the filter at ``c = 10^k`` (each times its power of ``c``)."""
        c = 10.0 ** k
        s = scaled(kw, c)
        p, y, t = prepared(s.pop("y"), s, grad=True)
        _loss(triton_filter(p, cfg), c, smoothed=False).backward()
        return [to_np(y.grad) * c, to_np(t["sigma"].grad) * c, to_np(t["obs_var"].grad) * c * c]

    base = grads(0)
    for k in (-140, 150):
        c = 10.0 ** k
        s = scaled(kw, c)
        p, _, _ = prepared(s.pop("y"), s)
        check_posterior(triton_smooth(p, cfg), ref, to_np(p.y), c, TOL, smoothed=True)
        for g, g0, name in zip(grads(k), base, ("y", "sigma", "obs_var")):
            err = np.max(np.abs(g - g0)) / np.max(np.abs(g0))
            assert err < TOL, f"k={k}: d/d{name} relative error {err:.3g}"


@pytest.mark.parametrize("backend", DIFFERENTIABLE)
def test_float32_sweep(backend):
    """float32 data across its range (``c^2`` a normal float32 number): the rich problem."""
    kw, ref = reference("rich")
    exponents = EXPONENTS_32[::2] if backend == "triton" else EXPONENTS_32
    for k in exponents:
        c, y, post = smoothed_at(kw, k, backend, np.float32)
        check_posterior(post, ref, y, c, FLOAT32_BOUND, smoothed=True)


def split(kw: dict, cut: int) -> tuple[dict, dict]:
    """The problem ``kw`` (the rich one) as a first chunk of ``cut`` steps and the rest, which
    continues from the first's state (no prior of its own)."""
    def part(sl):
        return {k: v[sl] if k == "times" else v[..., sl, :] if k in STEPPED else v for k, v in kw.items()}

    return part(slice(0, cut)), {k: v for k, v in part(slice(cut, None)).items() if k not in ("init_mean", "init_var")}


@pytest.mark.parametrize("backend", ("cpu", "torch", "reference"))
@pytest.mark.parametrize("k", (-150, 150))
def test_stream_sweep(backend, k):
    """A stream continued from a first chunk's state (``state=``) at scale: its filter equals the
    whole series' at ``c = 1`` scaled, its smoother the continued reference smoother at ``c = 1``."""
    kw, ref = reference("rich")
    c, cut = 10.0 ** k, 9
    head, tail = split(scaled(kw, c), cut)
    first = ks.filter(backend=backend, **head)
    post = ks.smooth(backend=backend, state=first.state, **tail)
    for name, power in FIELDS:
        check_field(getattr(post.filtered, name), getattr(ref.filtered, name)[..., cut:, :], c, power, TOL,
                    f"filtered {name}")
    shift = n_observed(ref, scaled(kw, c)["y"]) * math.log(c)
    err = np.abs(to_np(first.loglik) + to_np(post.loglik) + shift - ref.loglik)
    assert (err < TOL * (np.abs(ref.loglik) + np.abs(shift) + 1.0)).all()
    head1, tail1 = split(kw, cut)
    ref_tail = ks.smooth(backend="reference", state=ks.filter(backend="reference", **head1).state, **tail1)
    for name, power in FIELDS[:3]:
        check_field(getattr(post, name), getattr(ref_tail, name), c, power, TOL, f"smoothed {name}")


@pytest.mark.parametrize("backend", ("cpu", "torch", "triton"))
def test_stream_filter_sweep(backend):
    """:class:`kalmanscan.StreamFilter`, one step per update (its one-step kernels), at ``k`` in
    (-150, -80, 80, 150): every step's moments and the running log-likelihood."""
    kw, ref = reference("static")
    fields = ("mean", "var", "precision", "pred_mean", "pred_var", "pred_obs_var", "logliks")
    dev = device_of(backend)
    for k in (-150, -80, 80, 150):
        c = 10.0 ** k
        s = scaled(kw, c)
        f = ks.StreamFilter(theta=s["theta"], sigma=s["sigma"], obs_var=s["obs_var"], outputs=fields,
                            backend=backend)
        steps = [f.update(torch.tensor(y_t, device=dev)) for y_t in s["y"]]
        for name, power in FIELDS:
            if name in fields:
                got = np.stack([to_np(o[name]) for o in steps])
                check_field(got, getattr(ref.filtered, name), c, power, TOL, name)
        logliks = np.stack([to_np(o["logliks"]) for o in steps])
        check_loglik(SimpleNamespace(loglik=to_np(f.loglik), logliks=logliks), ref, s["y"], c, TOL)


def _loss(post, c: float, smoothed: bool) -> torch.Tensor:
    """A scale-free scalar of ``post`` at scale ``c``: the log-likelihood (its shift is constant)
    plus weighted means over ``c`` and variances over ``c^2``."""
    w = torch.linspace(-1.0, 1.0, post.mean.numel(), dtype=post.mean.dtype, device=post.mean.device)
    w = w.reshape(post.mean.shape)
    loss = post.loglik.sum() + (w * post.mean / c).sum() + (w * w * post.var / (c * c)).sum()
    if smoothed:
        f = post.filtered
        loss = loss + (w * f.mean / c).sum() + (w * f.var / (c * c)).sum()
    return loss


@pytest.mark.parametrize("backend", DIFFERENTIABLE)
def test_gradients_scale(backend):
    """Gradients at ``c = 10^k``, ``k`` in (-150, -80, 80, 150), times their power of ``c`` equal
    those at ``c = 1`` (``d/dy, d/dsigma, d/dmean ~ 1/c``, ``d/dobs_var ~ 1/c^2``, ``d/dtheta, d/dh``
    unchanged): the smoother's on cpu and torch, the filter's on triton (its smoother has no
    gradient)."""
    kw = rich_problem()
    kw.pop("init_var"), kw.pop("init_mean")
    kw["theta"] = np.array([0.3, 0.1, 1.5, 0.05])  # a stationary prior everywhere
    powers = dict(y=-1, sigma=-1, mean=-1, obs_var=-2, theta=0, h=0)
    smoothed = backend != "triton"
    dev = device_of(backend)

    def grads(k):
        c = 10.0 ** k
        s = scaled(kw, c)
        t = {k: torch.tensor(v, device=dev) if k == "times" else torch.tensor(v, device=dev, requires_grad=True)
             for k, v in s.items()}
        post = (ks.smooth if smoothed else ks.filter)(backend=backend, **t)
        _loss(post, c, smoothed).backward()
        out = {k: to_np(t[k].grad) * c ** -powers[k] for k in powers}
        out["y"] = np.nan_to_num(out["y"])  # missing values have no gradient
        return out

    base = grads(0)
    for k in ((-150, 150) if backend == "triton" else (-150, -80, 80, 150)):
        g = grads(k)
        for name, ref in base.items():
            assert np.isfinite(g[name]).all(), f"k={k}: d/d{name} not finite"
            err = np.max(np.abs(g[name] - ref)) / np.max(np.abs(ref))
            assert err < 1e-9, f"k={k}: d/d{name} relative error {err:.3g}"


def test_cli_at_scale(tmp_path, capsys):
    """``kalmanscan filter`` with sigma 0.5e80 and obs_var 1e160 prints numbers, not nan."""
    y = static_problem()["y"][:, :1] * 1e80
    src = tmp_path / "big.csv"
    src.write_text("t,x\n" + "".join(f"{i},{float(v)!r}\n" for i, v in enumerate(y[:, 0])))
    code = main(["filter", str(src), "--theta", "0.1", "--sigma", "0.5e80", "--obs-var", "1e160",
                 "-o", str(tmp_path / "out.csv")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "nan" not in out.out.lower()
    written = (tmp_path / "out.csv").read_text().lower()
    assert "nan" not in written and "inf" not in written
