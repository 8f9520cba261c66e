"""Streaming: many sensors updated one step per call, the filter's state carried between calls.

Each call is ``ks.filter(y[t:t+1], ..., state=state, outputs=...)`` on a ``(1, C)`` float32 step
(``C = 4096`` sensors by default) with per-sensor parameters, followed by ``state = post.state``.
For ``outputs=("mean", "var")`` (what a stream needs to continue) and for every field:

- :class:`kalmanscan.StreamFilter`'s ``update`` (parameters checked once), with and without
  ``check_finite``, calls per second, queued;

- *queued*: calls per second over ``--calls`` back-to-back calls, one synchronisation at the end
  (each call updates every sensor: sensor-updates per second are ``C`` times more);
- *alone*: the median wall time of one call followed by a synchronisation;
- the same loop without ``state`` (a fresh prior each call: the public call's fixed cost), and
  the backend alone on a prepared step (on CUDA the fused triton kernels,
  :func:`kalmanscan.ops.filter.triton.filter_forward`; on the CPU the backend's ``filter``), so
  the cost of the state and of the public call show separately;
- on CUDA, the device synchronisations of one call (``torch.cuda.set_sync_debug_mode``);
- on the CPU, what a user would write instead: the step in NumPy (:func:`numpy_step`), and with
  ``--host-params`` the :class:`~kalmanscan.StreamFilter` fed the same NumPy steps.

The stream is first checked against one call over the same steps (float32 against float32: the
largest relative difference of ``mean``, ``var`` and the summed log-likelihood). Target:
at least 5,000 calls per second for 4096 sensors on one H200.

    python -m benchmarks run stream --out stream.json                  # CUDA, backend auto (triton)
    python -m benchmarks run stream --device cpu --calls 200           # the same loop on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import kalmanscan as ks
from benchmarks.common import initial_state, save, synchronisations
from kalmanscan.inference.filtering import OUTPUTS
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter import get_backend, resolve_backend

FIELDS = {"mean_var": ("mean", "var"), "all": None}
STREAM_FIELDS = tuple(k for k in OUTPUTS if k not in ("loglik", "missing"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model(C: int, device: torch.device, host_params: bool, seed: int = 0) -> dict:
    """Per-sensor parameters ``(C,)`` (float32 tensors on ``device``, or NumPy with ``host_params``)."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(theta=torch.rand(C, generator=g) * 0.5 + 0.05, sigma=torch.rand(C, generator=g) + 0.2,
              obs_var=torch.rand(C, generator=g) + 0.1, mean=torch.randn(C, generator=g))
    return {k: v.numpy() if host_params else v.to(device) for k, v in kw.items()}


def check(y: torch.Tensor, kw: dict, backend: str, steps: int = 64) -> float:
    """Largest relative difference between ``steps`` one-step calls and one call over them."""
    whole = ks.filter(y[:steps], backend=backend, **kw)
    state, means, variances, loglik = None, [], [], 0.0
    for t in range(steps):
        post = ks.filter(y[t:t + 1], backend=backend, state=state, **kw)
        state = post.state
        means.append(post.mean)
        variances.append(post.var)
        loglik = loglik + post.loglik.double()
    errs = [float(((torch.cat(got) - ref).abs().max() / ref.abs().max()))
            for got, ref in ((means, whole.mean), (variances, whole.var))]
    errs.append(float((loglik - whole.loglik.double()).abs().max() / whole.loglik.double().abs().max()))
    return max(errs)


def rate(step, calls: int, device: torch.device) -> float:
    """Calls per second of ``step(t)`` for ``t < calls``, queued, synchronised at both ends."""
    step(0)
    sync(device)
    t0 = time.perf_counter()
    for t in range(calls):
        step(t)
    sync(device)
    return calls / (time.perf_counter() - t0)


def alone_ms(step, reps: int, device: torch.device) -> float:
    """Median wall milliseconds of one call followed by a synchronisation."""
    times = []
    for t in range(reps):
        sync(device)
        t0 = time.perf_counter()
        step(t)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def syncs_per_call(step, device: torch.device) -> int | None:
    """Device synchronisations of one call (CUDA only: ``torch.cuda.set_sync_debug_mode``)."""
    if device.type != "cuda":
        return None
    step(0)
    sync(device)
    return synchronisations(lambda: step(1))[1]


def backend_step(y: torch.Tensor, kw: dict, backend: str, outputs):
    """``step(t)`` running only the backend on step ``t`` of a prepared problem (the prior fixed)."""
    p = prepare(y[:1], backend=backend, **kw)
    name = resolve_backend(backend, y.device)
    if name == "triton":
        from kalmanscan.ops.filter.triton import backend as triton_backend

        views, init = triton_backend.kernel_views(p), initial_state(p)
        steps = [dict(views, y=y[t:t + 1].unsqueeze(0)) for t in range(y.shape[0])]
        return lambda t: triton_backend.filter_forward(steps[t], init, posterior=outputs or True)
    module = get_backend(name)
    problems = [prepare(y[t:t + 1], backend=backend, **kw) for t in range(y.shape[0])]
    return lambda t: module.filter(problems[t])


def numpy_step(y: torch.Tensor, kw: dict, first: ks.StreamState):
    """What a user would write on a CPU instead: the covariance-form step in NumPy with the
    transition ``(decay, noise)`` computed once (mean, variance and the log-likelihood's sum, as a
    stream needs), continuing the belief ``first`` after step 0. Returns ``(step(t), the largest
    relative error of its means over steps 1..64 against one ks.filter continuing first)``."""
    y_np = y.numpy()
    p = {k: np.asarray(v, np.float32) for k, v in kw.items()}
    decay = np.exp(-p["theta"])
    noise = (p["sigma"] ** 2 * -np.expm1(-2 * p["theta"]) / (2 * p["theta"])).astype(np.float32)
    R, m, log2pi = p["obs_var"], p["mean"], np.float32(np.log(2 * np.pi))
    state = dict(mean=first.mean.numpy().copy(), var=first.var.numpy().copy(), loglik=np.zeros_like(R))

    def step(t):
        z = decay * (state["mean"] - m)
        P = decay * decay * state["var"] + noise
        S = P + R
        v = y_np[t] - m - z
        state["mean"] = m + z + P / S * v
        state["var"] = P * R / S
        state["loglik"] += -0.5 * (log2pi + np.log(S) + v * v / S)

    whole = ks.filter(y[1:65], **kw, state=first)
    means = []
    for t in range(1, 65):
        step(t)
        means.append(state["mean"].copy())
    err = float(np.abs(np.stack(means) - whole.mean.numpy()).max() / np.abs(whole.mean.numpy()).max())
    return step, err


def run(C: int, calls: int, device: torch.device, backend: str, host_params: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    y = torch.randn(max(calls, 64) + 2, C, device=device, generator=g)
    kw = model(C, device, host_params)
    err = check(y, kw, backend)
    first = ks.filter(y[:1], backend=backend, **kw).state
    init = dict(init_mean=first.mean, init_var=first.var)
    rows = {}
    for label, outputs in FIELDS.items():
        state = [first]

        def streamed(t, outputs=outputs, state=state):
            state[0] = ks.filter(y[t:t + 1], backend=backend, state=state[0], outputs=outputs, **kw).state

        def fresh(t, outputs=outputs):
            ks.filter(y[t:t + 1], backend=backend, outputs=outputs, **init, **kw)

        kernels = backend_step(y, kw, backend, outputs)
        filters = {}
        for checked in (True, False):
            f = ks.StreamFilter(**kw, **init, backend=backend, outputs=outputs or STREAM_FIELDS, check_finite=checked)
            f.update(y[0])
            filters[checked] = f
        rows[label] = dict(stream_filter_calls_per_s=rate(lambda t, f=filters[True]: f.update(y[t]), calls, device),
                           stream_filter_unchecked_calls_per_s=rate(lambda t, f=filters[False]: f.update(y[t]),
                                                                    calls, device),
                           stream_filter_syncs_per_call=syncs_per_call(lambda t, f=filters[True]: f.update(y[t]),
                                                                       device),
                           stream_calls_per_s=rate(streamed, calls, device),
                           stream_alone_ms=alone_ms(streamed, min(calls, 200), device),
                           no_state_calls_per_s=rate(fresh, calls, device),
                           backend_calls_per_s=rate(kernels, calls, device),
                           stream_syncs_per_call=syncs_per_call(streamed, device))
    result = dict(C=C, calls=calls, backend=resolve_backend(backend, device), max_rel_error_stream_vs_one_call=err,
                  host_params=host_params, rows=rows)
    if device.type == "cpu":
        step, np_err = numpy_step(y, kw, first)
        result.update(numpy_step_calls_per_s=rate(step, calls, device), numpy_step_max_rel_error=np_err)
        if host_params:  # the same stream fed NumPy steps, as the NumPy user of the step above
            y_np = y.numpy()
            f = ks.StreamFilter(**kw, init_mean=first.mean.numpy(), init_var=first.var.numpy(), backend=backend)
            f.update(y_np[0])
            result["numpy_stream_filter_calls_per_s"] = rate(lambda t: f.update(y_np[t]), calls, device)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run stream``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sensors", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--host-params", action="store_true", help="parameters as NumPy (checked on the host)")
    ap.add_argument("--out")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    result = run(args.sensors, args.calls, device, args.backend, args.host_params)
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result["torch"] = torch.__version__
    print(f"{result['device']}, backend {result['backend']}, C = {args.sensors} sensors, one step per call; "
          f"stream vs one call: {result['max_rel_error_stream_vs_one_call']:.1e}")
    print("outputs   StreamFilter calls/s (syncs)  unchecked   ks.filter(state=) calls/s  alone ms  syncs  "
          "no-state calls/s  backend calls/s")
    for label, r in result["rows"].items():
        syncs, fsyncs = ("-" if r[k] is None else r[k]
                         for k in ("stream_syncs_per_call", "stream_filter_syncs_per_call"))
        print(f"{label:9} {r['stream_filter_calls_per_s']:20.0f} ({fsyncs})  "
              f"{r['stream_filter_unchecked_calls_per_s']:10.0f} "
              f"{r['stream_calls_per_s']:26.0f} {r['stream_alone_ms']:9.3f} {syncs:>6} "
              f"{r['no_state_calls_per_s']:17.0f} {r['backend_calls_per_s']:16.0f}")
    if "numpy_step_calls_per_s" in result:
        print(f"a NumPy step (mean, variance, log-likelihood; against ks.filter "
              f"{result['numpy_step_max_rel_error']:.1e}): {result['numpy_step_calls_per_s']:.0f} calls/s")
    if "numpy_stream_filter_calls_per_s" in result:
        print(f"StreamFilter fed NumPy steps (mean and variance, checked): "
              f"{result['numpy_stream_filter_calls_per_s']:.0f} calls/s")
    save(args.out, result)


if __name__ == "__main__":
    main()
