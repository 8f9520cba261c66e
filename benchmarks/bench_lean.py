"""The default ``ks.filter`` call (the backend writes the filtered mean and variance and the
log-likelihood's sum; the other fields are derived when read) beside a plain NumPy loop over time,
vectorised over series, that writes the mean and variance and sums the log-likelihood, in one
process on the CPU; on the GPU beside the triton kernels that write the mean and variance alone.
A script, not a test.

    python -m benchmarks run lean [--out lean.json] [--repeat 3] [--shapes 10000x1000,1000000x10] [--times]
    python -m benchmarks run lean --device cuda [--out lean_gpu.json] [--shapes 32768x4096]

CPU, for each shape ``(T, C)`` of float64 data (``C`` series of ``T`` steps, static parameters):
the median of ``--repeat`` wall times after one warm-up call of the default call, of the call with
every field read, and of the NumPy loop (``speedup``: loop over default call); then the peak
resident memory beyond the input of a default call whose ``mean`` and ``var`` are read (``/proc``
peak RSS, reset before the call), over the bytes of the mean and variance (``memory_ratio``). With
``--times``, irregular times (steps uniform in ``[0.5, 1.5)``) and a rate per series (uniform in
``[0.1, 0.5)``): the call takes ``times=``, and the loop discretises each step for every series.

GPU (``--device cuda``), float32, the GPU's time per call (``triton.testing.do_bench``, calls back
to back): the default call reading ``mean``, ``var`` and ``loglik`` with ``theta`` a CUDA tensor
(``default_ms``; also without ``y``'s inf check, ``unchecked_ms``; with ``theta`` a NumPy array,
checked on the host, ``host_params_ms``; with every field read, ``every_field_ms``), the forward
kernels writing the mean and variance alone (``moments_ms``) and with the log-likelihood's sum
(``lean_kernels_ms``); ``ratio`` is ``default_ms / moments_ms`` (target at most 1.1),
``host_params_ratio`` the same for ``host_params_ms``. ``do_bench`` empties the L2 cache before
each call; the ``*_loop_ms`` columns time a loop instead (:func:`benchmarks.common.timed`: 20 calls
back to back between two CUDA events, as a user's loop runs them; ``loop_ratio`` and
``host_params_loop_ratio`` over ``moments_loop_ms``). The DRAM limit is the bytes the call must
move, ``y`` read once and the mean and variance written (12 bytes a step-channel), at the
device-to-device copy bandwidth measured in the same run (``fraction_of_copy``: that floor over
``default_ms``).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

import kalmanscan as ks
from benchmarks.common import (copy_bandwidth, every_field, shape_list, shapes_parser, timed, wall_times,
                               write_shape_rows)
from benchmarks.common import median_ms as device_ms
from kalmanscan.problem.prepare import prepare

SHAPES = [(10_000, 1000), (1_000_000, 10)]
GPU_SHAPES = [(32_768, 4096)]
PARAMS = dict(theta=0.3, sigma=1.0, obs_var=0.5)


def numpy_loop(y: np.ndarray, theta: float | np.ndarray, sigma: float, obs_var: float,
               times: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """The covariance-form filter of ``y`` ``(T, C)`` from the stationary prior, a loop over time
    vectorised over series (``theta`` a number or ``(C,)``; with ``times``, ``(T,)``, each step
    discretised over its own length): ``(mean, var, loglik)``, ``(T, C)``, ``(T, C)``, ``(C,)``."""
    T, C = y.shape
    a, q = ks.ou.discretize(theta, sigma, 1.0)
    mean, var = np.empty_like(y), np.empty_like(y)
    z, P = np.zeros(C), np.full(C, ks.ou.stationary_var(theta, sigma))
    loglik = np.zeros(C)
    log2pi = math.log(2 * math.pi)
    for t in range(T):
        if t and times is not None:
            a, q = ks.ou.discretize(theta, sigma, times[t] - times[t - 1])
        if t:
            z = a * z
            P = a * a * P + q
        S = P + obs_var
        v = y[t] - z
        z = z + P / S * v
        P = P * (obs_var / S)
        mean[t], var[t] = z, P
        loglik -= 0.5 * (log2pi + np.log(S) + v * v / S)
    return mean, var, loglik


def _rss(field: str) -> int:
    """``VmHWM`` or ``VmRSS`` of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_beyond(fn) -> int:
    """Peak resident bytes while ``fn()`` runs beyond those before it (the peak reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    fn()
    return _rss("VmHWM") - before


def median_ms(fn, repeat: int) -> float:
    return 1e3 * float(np.median(wall_times(fn, repeat)))


def row(T: int, C: int, repeat: int, times: bool = False) -> dict:
    rng = np.random.default_rng(0)
    y = rng.normal(size=(T, C))
    kw = dict(PARAMS)
    if times:
        kw.update(theta=rng.uniform(0.1, 0.5, C), times=np.cumsum(rng.uniform(0.5, 1.5, T)))

    def default():
        post = ks.filter(y, **kw)
        return post.mean, post.var, post.loglik

    every = every_field(lambda: ks.filter(y, **kw))
    out = dict(T=T, C=C, times=times, default_ms=median_ms(default, repeat), every_field_ms=median_ms(every, repeat),
               numpy_loop_ms=median_ms(lambda: numpy_loop(y, **kw), repeat))
    out["speedup"] = out["numpy_loop_ms"] / out["default_ms"]
    moments = 2 * y.nbytes
    out["peak_beyond_input_mb"] = peak_beyond(default) / 1e6
    out["memory_ratio"] = out["peak_beyond_input_mb"] * 1e6 / moments
    return out


def gpu_row(T: int, C: int, repeat: int) -> dict:
    """The GPU row of ``(T, C)`` float32 data (``repeat`` unused: ``do_bench`` picks its count)."""
    from kalmanscan.ops.filter.triton import backend as triton_backend  # triton: imported for the GPU alone

    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(T, C, device="cuda", generator=g)
    kw = dict(theta=torch.rand(C, device="cuda", generator=g) + 0.05, sigma=0.5, obs_var=0.3)

    def default(params=kw, **options):
        post = ks.filter(y, **params, **options)
        return post.mean, post.var, post.loglik

    host_kw = dict(kw, theta=kw["theta"].cpu().numpy())  # theta checked on the host (copied once, not per call)
    every = every_field(lambda: ks.filter(y, **kw))
    p = prepare(y, backend="triton", **kw)
    views, init = triton_backend.kernel_views(p), triton_backend.initial_state(p)

    def kernels(*fields):
        return triton_backend.filter_forward(views, init, posterior=fields)

    calls = dict(default=default, host_params=lambda: default(host_kw), moments=lambda: kernels("mean", "var"))
    out = dict(T=T, C=C, device=torch.cuda.get_device_name(), default_ms=device_ms(default),
               unchecked_ms=device_ms(lambda: default(check_finite=False)),
               host_params_ms=device_ms(calls["host_params"]), every_field_ms=device_ms(every),
               moments_ms=device_ms(calls["moments"]),
               lean_kernels_ms=device_ms(lambda: kernels("mean", "var", "loglik")))
    out["ratio"] = out["default_ms"] / out["moments_ms"]
    out["host_params_ratio"] = out["host_params_ms"] / out["moments_ms"]
    out.update({f"{k}_loop_ms": timed(fn) for k, fn in calls.items()})
    out["loop_ratio"] = out["default_loop_ms"] / out["moments_loop_ms"]
    out["host_params_loop_ratio"] = out["host_params_loop_ms"] / out["moments_loop_ms"]
    out["copy_gb_s"] = copy_bandwidth()
    out["floor_ms"] = 12 * T * C / out["copy_gb_s"] / 1e6
    out["fraction_of_copy"] = out["floor_ms"] / out["default_ms"]
    return out


def parser():
    """The command line: ``--out`` (JSON file), ``--repeat``, ``--shapes`` (``TxC,...``) and
    ``--device``."""
    ap = shapes_parser(__doc__.splitlines()[0], repeat=3)
    ap.add_argument("--shapes", default=None, help="TxC,... (default 10000x1000,1000000x10; on cuda 32768x4096)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: against the NumPy loop; cuda: against the mean-and-variance kernels")
    ap.add_argument("--times", action="store_true",
                    help="cpu: irregular times and a rate per series (the call's per-step path)")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    gpu = args.device == "cuda"
    shapes = (GPU_SHAPES if gpu else SHAPES) if args.shapes is None else shape_list(args.shapes)
    if gpu:
        return write_shape_rows(args, shapes, gpu_row)
    if not os.path.exists("/proc/self/clear_refs"):
        raise SystemExit("bench_lean reads peak memory from /proc (Linux)")
    return write_shape_rows(args, shapes, lambda T, C, repeat: row(T, C, repeat, args.times))


if __name__ == "__main__":
    main()
