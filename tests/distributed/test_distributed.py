"""ks.distributed on CPU with gloo: 4 spawned processes against the single-process result.

Four ranks have a first rank, two middle ones and a last one, so the carries compose over more
than one rank in the forward (the exclusive prefix) and in the backward (the suffix of boundary
Jacobians); two ranks would add no path. The one group runs every check (process start-up
dominates the cost). Every rank builds the same random global problem from one seed, takes its
stretch (one of them a single step), runs the distributed call and compares its rows (and
gradients) with the single-process call on the whole series. The summaries in chunks and in
pieces are tested directly, in test_summaries.py.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kalmanscan as ks

TOL = 1e-10      # float64 against float64
F32_TOL = 1e-5   # float32 (the triton kernels) against float64
FIELDS = ("mean", "var", "precision", "pred_mean", "pred_var", "pred_obs_mean", "pred_obs_var",
          "logliks")


def _close(actual, ref, what, tol=TOL):
    a, r = actual.detach().double(), ref.detach().double()
    assert a.shape == r.shape, (what, a.shape, r.shape)
    assert torch.isfinite(a).all(), what
    err = float((a - r).abs().max() / r.abs().max().clamp_min(1e-300))
    assert err < tol, f"{what}: relative error {err:.2e}"


def _bounds(world, seed):
    """Random stretch lengths (one of them 1), as cumulative bounds."""
    g = np.random.default_rng(seed)
    lengths = g.integers(2, 9, size=world)
    lengths[g.integers(world)] = 1
    return np.concatenate([[0], np.cumsum(lengths)])


def _leaf(x):
    return x.detach().clone().requires_grad_()


def _series_problem(T, seed):
    g = torch.Generator().manual_seed(seed)
    B, C = 2, 3
    y = torch.randn(B, T, C, generator=g, dtype=torch.float64) * 2 + 1
    y[torch.rand(B, T, C, generator=g) < 0.2] = float("nan")
    times = torch.cumsum(torch.rand(T, generator=g, dtype=torch.float64) * 2 + 0.1, 0) + 100.0
    kw = dict(theta=torch.tensor([0.3, 0.0, 1.5], dtype=torch.float64),
              sigma=torch.rand(C, generator=g, dtype=torch.float64) + 0.5,
              obs_var=torch.rand(B, T, C, generator=g, dtype=torch.float64) + 0.2,
              mean=torch.randn(T, C, generator=g, dtype=torch.float64),
              init_mean=torch.randn(C, generator=g, dtype=torch.float64),
              init_var=torch.rand(C, generator=g, dtype=torch.float64) + 0.5)
    weights = {k: torch.randn(B, T, C, generator=g, dtype=torch.float64) for k in FIELDS}
    return y, times, kw, weights


def _local_kw(kw, lo, hi, rank):
    out = {}
    for k, v in kw.items():
        if k in ("init_mean", "init_var"):
            if rank == 0:
                out[k] = v
        else:
            out[k] = v[..., lo:hi, :] if v.ndim >= 2 else v
    return out


def _loss(post, weights, lo, hi):
    return sum((getattr(post, k) * weights[k][..., lo:hi, :]).sum() for k in FIELDS)


def _check_series(rank, world, smooth, backend="torch"):
    bounds = _bounds(world, 7 + world + smooth)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    y, times, kw, weights = _series_problem(int(bounds[-1]), seed=11 + world + smooth)
    full_kw = {k: _leaf(v) for k, v in kw.items()}
    y_full = _leaf(y)
    extra = dict(times=times) if not smooth else dict(dt=0.7)
    run_full = ks.smooth if smooth else ks.filter
    ref = run_full(y_full, backend="torch", **full_kw, **extra)
    _loss(ref, weights, 0, len(times)).backward()

    local_kw = {k: _leaf(v) for k, v in _local_kw(kw, lo, hi, rank).items()}
    y_local = _leaf(y[..., lo:hi, :])
    extra = dict(times=times[lo:hi]) if not smooth else dict(dt=0.7)
    run = ks.distributed.smooth if smooth else ks.distributed.filter
    post = run(y_local, **local_kw, **extra, backend=backend)
    for k in FIELDS:
        _close(getattr(post, k), getattr(ref, k)[..., lo:hi, :], f"rank {rank} {k}")
    if smooth:
        _close(post.filtered.mean, ref.filtered.mean[..., lo:hi, :], f"rank {rank} filtered mean")
    _loss(post, weights, lo, hi).backward()

    _close(y_local.grad.nan_to_num(), y_full.grad[..., lo:hi, :].nan_to_num(), f"rank {rank} d y")
    for k in ("obs_var", "mean"):
        _close(local_kw[k].grad, full_kw[k].grad[..., lo:hi, :], f"rank {rank} d {k}")
    for k in ("theta", "sigma", "init_mean", "init_var"):
        grad = local_kw[k].grad if k in local_kw else torch.zeros_like(full_kw[k])
        dist.all_reduce(grad)
        _close(grad, full_kw[k].grad, f"rank {rank} d {k}")


def _check_fused_summary(rank, world):
    """No gradients and backend="triton": the summaries come from the aggregate kernel."""
    bounds = _bounds(world, 40 + world)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    y, times, kw, _ = _series_problem(int(bounds[-1]), seed=41 + world)
    ref = ks.filter(y, times=times, backend="torch", **kw)
    with torch.no_grad():
        post = ks.distributed.filter(y[..., lo:hi, :], times=times[lo:hi], backend="triton",
                                     **_local_kw(kw, lo, hi, rank))
    for k in FIELDS:
        _close(getattr(post, k), getattr(ref, k)[..., lo:hi, :], f"rank {rank} fused {k}")


def _kla_problem(L, seed, B=2, M=3):
    g = torch.Generator().manual_seed(seed)
    S = 2
    f64 = dict(generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, L, S, **f64), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(B, L, S, **f64), dim=-1)
    return dict(v=torch.randn(B, L, M, **f64), lam_v=torch.rand(B, L, M, **f64) * 3 + 0.1, k=k, q=q,
                decay=torch.rand(M, S, **f64) * 0.5 + 0.45, noise=torch.rand(M, S, **f64) * 0.3)


def _check_kla(rank, world, backend="torch"):
    """Values and gradients; ``backend="triton"`` computes in float32 (two local fused backward
    passes, boundary Jacobians at the middle ranks) and is held to float32 rounding."""
    tol = TOL if backend == "torch" else F32_TOL
    bounds = _bounds(world, 3 + world)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    args = _kla_problem(int(bounds[-1]), seed=5 + world)
    w = torch.randn(2, int(bounds[-1]), 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    full = {k: _leaf(v) for k, v in args.items()}
    y, y_var = ks.nn.kla_scan(*full.values(), backend="torch")
    (y * w + y_var * w.flip(-1)).sum().backward()

    cast = (lambda x: x) if backend == "torch" else (lambda x: x.float())
    local = {k: _leaf(cast(v[:, lo:hi] if v.ndim == 3 else v)) for k, v in args.items()}
    y_l, y_var_l = ks.distributed.kla_scan(*local.values(), backend=backend)
    _close(y_l, y[:, lo:hi], f"rank {rank} kla y", tol)
    _close(y_var_l, y_var[:, lo:hi], f"rank {rank} kla y_var", tol)
    (y_l * w[:, lo:hi] + y_var_l * w[:, lo:hi].flip(-1)).sum().backward()
    for k, v in local.items():
        if v.ndim == 3:
            _close(v.grad, full[k].grad[:, lo:hi], f"rank {rank} kla d {k}", tol)
        else:
            grad = v.grad.clone()
            dist.all_reduce(grad)
            _close(grad, full[k].grad, f"rank {rank} kla d {k}", tol)


def _check_kla_fused(rank, world):
    """No gradients and backend="triton": the summaries come from the piece-map kernel (float32)."""
    bounds = _bounds(world, 50 + world)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    args = {k: v.float() for k, v in _kla_problem(int(bounds[-1]), seed=51 + world).items()}
    y, y_var = ks.nn.kla_scan(*(v.double() for v in args.values()), backend="torch")
    with torch.no_grad():
        y_l, y_var_l = ks.distributed.kla_scan(*(v[:, lo:hi] if v.ndim == 3 else v for v in args.values()),
                                               backend="triton")
    _close(y_l, y[:, lo:hi], f"rank {rank} fused kla y", F32_TOL)
    _close(y_var_l, y_var[:, lo:hi], f"rank {rank} fused kla y_var", F32_TOL)


def _check_model(rank, world):
    torch.manual_seed(0)
    model = ks.nn.SequenceModel(11, 8, 2, mixer="kla", d_state=4, backend="torch", dtype=torch.float64)
    per_rank = 4
    tokens = torch.randint(0, 11, (2, per_rank * world), generator=torch.Generator().manual_seed(2))
    w = torch.randn(2, per_rank * world, 11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    logits = model(tokens)
    (logits * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    lo, hi = rank * per_rank, (rank + 1) * per_rank
    with ks.distributed.sequence_parallel(model):
        logits_l = model(tokens[:, lo:hi])
    _close(logits_l, logits[:, lo:hi], f"rank {rank} model logits")
    (logits_l * w[:, lo:hi]).sum().backward()
    ks.distributed.reduce_gradients(model)
    for n, p in model.named_parameters():
        _close(p.grad, ref_grads[n], f"rank {rank} model d {n}")


def _check_numpy(rank, world):
    """NumPy in, NumPy out (gloo), float64, static parameters, no times."""
    bounds = _bounds(world, 60 + world)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    y = np.random.default_rng(61).normal(size=(int(bounds[-1]), 2))
    kw = dict(theta=[0.2, 0.9], sigma=1.3, obs_var=[0.4, 2.0], mean=0.5)
    ref = ks.filter(y, backend="torch", **kw)
    post = ks.distributed.filter(y[lo:hi], **kw)
    assert isinstance(post.mean, np.ndarray)
    for k in FIELDS:
        _close(torch.from_numpy(getattr(post, k)), torch.from_numpy(getattr(ref, k)[lo:hi]),
               f"rank {rank} numpy {k}")


def _check_errors(rank, world):
    y = torch.randn(4, 2, dtype=torch.float64)
    bad = -1.0 if rank == world - 1 else 1.0
    with pytest.raises(ValueError, match="obs_var" if rank == world - 1 else "rank"):
        ks.distributed.filter(y, theta=0.5, sigma=1.0, obs_var=bad)
    torch.manual_seed(0)
    model = ks.nn.SequenceModel(11, 8, 1, mixer="kla", d_state=4, backend="torch", dtype=torch.float64)
    tokens = torch.zeros(1, 2 if rank == world - 1 else 4, dtype=torch.long)
    with pytest.raises(ValueError, match="d_conv" if rank == world - 1 else "rank"):
        with ks.distributed.sequence_parallel(model):
            model(tokens)
    times = torch.arange(4, dtype=torch.float64) + (0.0 if rank < world - 1 else -10.0)
    with pytest.raises(ValueError, match="increasing across ranks"):
        ks.distributed.filter(y, theta=0.5, sigma=1.0, obs_var=1.0, times=times)
    last = rank == world - 1  # the same number of filters, another layout or dtype, on the last rank
    swapped = torch.randn(3, 4, 2, dtype=torch.float64) if last else torch.randn(2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"same \(\.\.\., C\)"):
        ks.distributed.filter(swapped, theta=0.5, sigma=1.0, obs_var=1.0)
    with pytest.raises(ValueError, match="same dtype"):
        ks.distributed.filter(y.float() if last else y, theta=0.5, sigma=1.0, obs_var=1.0)
    with pytest.raises(ValueError, match="init_var" if rank == 0 else "rank 0"):
        ks.distributed.filter(y, theta=0.5, sigma=1.0, obs_var=1.0, init_var=float("inf"))
    args = _kla_problem(3, seed=1, B=3 if last else 2, M=2 if last else 3)
    with pytest.raises(ValueError, match="same on every rank"):
        ks.distributed.kla_scan(*args.values(), backend="torch")
    args = _kla_problem(3, seed=1)
    with pytest.raises(ValueError, match="dtypes must be the same"):
        ks.distributed.kla_scan(*(v.float() if last else v for v in args.values()), backend="torch")


def _check_gradients_on_one_rank(rank, world):
    """Only rank 1's ``y`` needs a gradient: every rank's outputs still lead to the collective
    backward (rank 0's too, though nothing of its own needs one), so no rank waits."""
    bounds = _bounds(world, 70 + world)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    y, _, kw, _ = _series_problem(int(bounds[-1]), seed=71)
    y_full = _leaf(y)
    ks.filter(y_full, backend="torch", **kw).mean.sum().backward()
    y_local = _leaf(y[..., lo:hi, :]) if rank == 1 else y[..., lo:hi, :]
    post = ks.distributed.filter(y_local, backend="torch", **_local_kw(kw, lo, hi, rank))
    assert post.mean.requires_grad
    post.mean.sum().backward()
    if rank == 1:
        _close(y_local.grad.nan_to_num(), y_full.grad[..., lo:hi, :].nan_to_num(), "d y on rank 1")


def _check_no_noise(rank, world):
    """sigma = 0 with decay < 1: the precision entering later ranks is out of float32's range; the
    carry travels as variance and mean, so every rank's rows stay finite and equal one process."""
    bounds = _bounds(world, 60 + world)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    g = torch.Generator().manual_seed(61)
    y = torch.randn(int(bounds[-1]) * 20, 3, generator=g)
    kw = dict(theta=torch.tensor([1.0, 0.1, 0.0]), sigma=0.0, obs_var=0.7, init_var=2.0)
    lo, hi = lo * 20, hi * 20
    ref = ks.filter(y, backend="torch", **kw)
    post = ks.distributed.filter(y[lo:hi], backend="torch", **kw)
    for k in ("mean", "var", "logliks"):
        assert torch.isfinite(getattr(post, k)).all(), f"rank {rank} {k}"
        _close(getattr(post, k), getattr(ref, k)[lo:hi], f"rank {rank} no-noise {k}", tol=F32_TOL)


def _worker(rank, world, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _check_series(rank, world, smooth=False)
        _check_series(rank, world, smooth=True)
        _check_fused_summary(rank, world)
        _check_kla(rank, world)
        _check_kla_fused(rank, world)
        _check_numpy(rank, world)
        _check_errors(rank, world)
        _check_gradients_on_one_rank(rank, world)
        _check_no_noise(rank, world)
        _check_model(rank, world)
        _check_kla(rank, world, backend="triton")
        _check_series(rank, world, smooth=True, backend="triton")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_equals_single_process():
    # A fork server that has imported torch and kalmanscan once forks every rank (no per-rank
    # import of torch), and it never ran torch's thread pools, which a plain fork would inherit.
    # torch._dynamo is what torch.utils.checkpoint (the chunked summaries) imports on first use:
    # several seconds per rank otherwise. (Preload names must import without this directory on
    # sys.path.)
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "pytest", "kalmanscan.distributed",
                                            "kalmanscan.nn.model"])
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store")), nprocs=world,
                           join=True, start_method="forkserver")
