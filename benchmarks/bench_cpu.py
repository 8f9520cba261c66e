"""The ``"cpu"`` backend (compiled loops) against what a CPU user would pick instead, in one process.

Every contender filters the same NumPy float64 data (OU prior with a rate per series, h = 1, mean 0,
stationary start, no missing values; ``N`` series as the channels of ``y``, shape ``(T, N)``) and
is checked against the ``"cpu"`` backend before it is timed:

* ``ks.filter(y, backend="cpu")``: the public call on NumPy float64 (and float32) input with every
  field of the :class:`~kalmanscan.Posterior` read (validation, the compiled loop, the derived
  fields), as the other contenders compute them; the default call reading only the mean and
  variance is :mod:`benchmarks.bench_lean`'s;
* the compiled loop alone with only ``mean, var`` written (``cpu.filter(p, outputs=...)``, no
  validation): what the memory traffic of the ten outputs costs;
* the memory floor: allocating and filling ten float64 arrays of ``y``'s shape (no filter), what
  any filter returning the ten outputs in fresh memory pays at least;
* for the log-likelihood, the public call with ``outputs=("loglik",)``;
* ``ks.filter(y, backend="torch")``: the time-parallel scan in torch;
* a NumPy loop over time, vectorised over series, computing the same fields;
* statsmodels' ``UnobservedComponents(irregular, autoregressive=1).loglike`` per series (the model
  built outside the timing; for more than one series one is timed and the time multiplied,
  labelled "extrapolated");
* simdkalman, if installed;
* filterpy's and pykalman's filters, if installed, on one series of at most :data:`SUBSET` steps,
  the time multiplied to the whole shape (labelled "extrapolated");
* ``ks.fit`` of the local level on the bundled Nile series (exact diffuse prior) against
  statsmodels' ``UnobservedComponents("llevel").fit()``, log-likelihoods compared.

Each contender's result is checked against the cpu backend on its warm-up call; then the
contenders run in turns, ``--repeat`` rounds (a contender slower than :data:`SLOW_S` in one
round only), and the table gives the median wall time and the median CPU time of the process
(all threads: on a shared machine it shows the work when the wall time shows the waiting) with
its system part (the kernel's work, mostly mapping and zeroing the fresh pages of the outputs,
whose cost on a virtual machine varies with the history of the process). The first call of the
compiled loop in this process (numba's on-disk cache load or compile) is
reported separately. ::

    python -m benchmarks run cpu [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import numpy as np
import torch

import kalmanscan as ks
from benchmarks.common import every_field, save
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.cpu import backend as cpu

# (series N, steps T, what is compared)
SHAPES = [(1000, 10_000, "all"), (10, 1_000_000, "all"), (1, 10_000, "loglik"), (50, 500, "all")]
QUICK = [(100, 2_000, "all"), (4, 50_000, "all"), (1, 10_000, "loglik"), (50, 500, "all")]
SLOW_S = 5.0  # a contender whose warm-up took longer than this is timed once


def problem(N, T, seed=0):
    rng = np.random.default_rng(seed)
    theta = rng.uniform(0.05, 0.5, N)
    sigma, obs_var = 1.0, 0.5
    a = np.exp(-theta)
    x = np.zeros((T, N))
    x[0] = rng.normal(size=N) * sigma / np.sqrt(2 * theta)
    noise = rng.normal(size=(T, N)) * sigma * np.sqrt(-np.expm1(-2 * theta) / (2 * theta))
    for t in range(1, T):
        x[t] = a * x[t - 1] + noise[t]
    y = x + np.sqrt(obs_var) * rng.normal(size=(T, N))
    return y, dict(theta=theta, sigma=sigma, obs_var=obs_var)


def numpy_loop(y, theta, sigma, obs_var):
    """The covariance-form filter as a loop over time, vectorised over series: the fields of the
    Posterior (mean, var, precision, pred_mean, pred_var, pred_precision, pred_obs_mean,
    pred_obs_var, logliks)."""
    T, N = y.shape
    decay, noise = ks.ou.discretize(theta, sigma, 1.0)
    out = {k: np.empty((T, N)) for k in ("mean", "var", "precision", "pred_mean", "pred_var",
                                          "pred_precision", "pred_obs_mean", "pred_obs_var", "logliks")}
    z = np.zeros(N)
    P = np.broadcast_to(ks.ou.stationary_var(theta, sigma), (N,)).astype(float)
    log2pi = math.log(2 * math.pi)
    for t in range(T):
        if t:
            z = decay * z
            P = decay * decay * P + noise
        S = P + obs_var
        v = y[t] - z
        out["pred_mean"][t] = out["pred_obs_mean"][t] = z
        out["pred_var"][t] = P
        out["pred_precision"][t] = 1.0 / P
        out["pred_obs_var"][t] = S
        out["logliks"][t] = -0.5 * (log2pi + np.log(S) + v * v / S)
        z = z + (P / S) * v
        P = P * obs_var / S
        out["mean"][t] = z
        out["var"][t] = P
        out["precision"][t] = 1.0 / P
    return out


def write_outputs(shape, n):
    """What writing ``n`` fresh output arrays of ``shape`` costs alone: the memory floor of a
    filter that returns them (allocation, first touch, one write of every element)."""
    out = [np.empty(shape) for _ in range(n)]
    for x in out:
        x.fill(1.0)
    return out


def statsmodels_models(y, kw):
    import statsmodels.api as sm

    models = []
    for i in range(y.shape[1]):
        decay, noise = ks.ou.discretize(kw["theta"][i], kw["sigma"], 1.0)
        mod = sm.tsa.UnobservedComponents(y[:, i], irregular=True, autoregressive=1)
        models.append((mod, np.array([kw["obs_var"], noise, decay])))
    return models


def simdkalman_filter(y, kw):
    """simdkalman on every series with the first series' rate (it takes one model for all series:
    its state transition's leading axis is the state, not the series)."""
    import simdkalman

    decay, noise = ks.ou.discretize(kw["theta"][0], kw["sigma"], 1.0)
    kf = simdkalman.KalmanFilter(state_transition=np.array([[decay]]), process_noise=np.array([[noise]]),
                                 observation_model=np.eye(1), observation_noise=kw["obs_var"])
    init_var = float(ks.ou.stationary_var(kw["theta"][0], kw["sigma"]))
    N = y.shape[1]
    return kf.compute(y.T, 0, initial_value=np.zeros((N, 1, 1)), initial_covariance=np.array([[init_var]]),
                      filtered=True, smoothed=False, log_likelihood=True)


SUBSET = 10_000  # steps of one series that filterpy and pykalman filter (then extrapolated)


def filterpy_filter(y1, decay, noise, obs_var, init_var):
    """filterpy's ``KalmanFilter.batch_filter`` on one series (predict then update each step; the
    stationary prior with mean 0 is unchanged by the first prediction, so the moments agree)."""
    from filterpy.kalman import KalmanFilter

    kf = KalmanFilter(dim_x=1, dim_z=1)
    kf.F, kf.H = np.array([[decay]]), np.array([[1.0]])
    kf.Q, kf.R = np.array([[noise]]), np.array([[obs_var]])
    kf.x, kf.P = np.zeros((1, 1)), np.array([[init_var]])
    means, _, _, _ = kf.batch_filter(y1)
    return means[:, 0, 0]


def pykalman_filter(y1, decay, noise, obs_var, init_var):
    from pykalman import KalmanFilter

    kf = KalmanFilter(transition_matrices=[[decay]], observation_matrices=[[1.0]],
                      transition_covariance=[[noise]], observation_covariance=[[obs_var]],
                      initial_state_mean=[0.0], initial_state_covariance=[[init_var]])
    means, _ = kf.filter(y1)
    return means[:, 0]


def fit_rows(repeat, have):
    """``ks.fit`` of the Nile local level (exact diffuse prior) against statsmodels' fit."""
    nile = ks.datasets.load_nile()
    y = np.asarray(nile.y, float).reshape(-1, 1)

    def ours():
        return ks.fit(y, theta=0.0, init_var=math.inf, estimate=("sigma", "obs_var"), progress=False)

    ref = float(np.asarray(ours().loglik).ravel()[0])
    c = [("ks.fit cpu (L-BFGS)", ours, lambda r: rel(np.asarray(r.loglik).ravel()[0], ref),
          "exact diffuse prior, loglik without the diffuse step")]
    if have["statsmodels"]:
        import statsmodels.api as sm

        def theirs():
            mod = sm.tsa.UnobservedComponents(y[:, 0], "llevel", use_exact_diffuse=True)
            return mod.fit(disp=False)

        c.append(("statsmodels fit", theirs, lambda r: rel(r.llf_obs[1:].sum(), ref),
                  "UnobservedComponents('llevel'), exact diffuse; loglik without the diffuse step"))
    rows = run_round_robin(c, repeat)
    for row in rows:
        row.update(N=1, T=y.shape[0], what="fit")
    return rows


SETTLE_BYTES = 1 << 30


def settle(nbytes=SETTLE_BYTES):
    """Allocate ``nbytes`` of fresh memory, touch every page and free it, untimed: the kernel's
    debt for the previous contender's freed memory (compacting it back into huge pages) is paid
    here, not by the next contender's first large allocation (on the project's 2-core machine the
    first 800 MB allocated after simdkalman's run cost 0.5-0.7 s of system time, the next 0.1 s)."""
    np.ones(nbytes // 8)


def run_round_robin(contenders, repeat):
    """Time ``contenders`` (``(name, fn, check, note)``; ``check(result)`` gives the error against
    the cpu backend) in turns, so that a change of load on a shared machine hits them alike: one
    warm-up call each (its result checked), then ``repeat`` rounds of one call each (a contender
    whose warm-up took more than :data:`SLOW_S` runs in the first round only), each call after
    :func:`settle`. Returns rows with
    the median wall time, the median process CPU time (all threads) and the median system part of
    it (the kernel's work: mostly zeroing and mapping fresh pages for the outputs) of each."""
    rows, slow = [], set()
    for name, fn, check, note in contenders:
        t0 = time.perf_counter()
        err = check(fn())
        if time.perf_counter() - t0 > SLOW_S:
            slow.add(name)
        rows.append(dict(contender=name, max_rel_err=err, note=note, wall=[], cpu=[], sys=[]))
    for r in range(repeat):
        for row, (name, fn, _, _) in zip(rows, contenders):
            if r and name in slow:
                continue
            settle()
            c0, t0 = os.times(), time.perf_counter()
            fn()
            row["wall"].append(time.perf_counter() - t0)
            c1 = os.times()
            row["cpu"].append(c1.user + c1.system - c0.user - c0.system)
            row["sys"].append(c1.system - c0.system)
    for row in rows:
        row["calls"] = len(row["wall"])
        row["seconds"] = statistics.median(row.pop("wall"))
        row["cpu_seconds"] = statistics.median(row.pop("cpu"))
        row["sys_seconds"] = statistics.median(row.pop("sys"))
    return rows


def rel(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def bench_shape(N, T, what, repeat, have):
    y, kw = problem(N, T)
    y32 = y.astype(np.float32)
    ref = ks.filter(y, backend="cpu", **kw)
    if what == "loglik":
        def public(yy, backend):
            return lambda: ks.filter(yy, backend=backend, **kw).loglik

        def check_post(x):
            return rel(x, ref.loglik)
    else:
        def public(yy, backend):
            return every_field(lambda: ks.filter(yy, backend=backend, **kw))

        def check_post(x):
            return max(rel(x.mean, ref.mean), rel(x.var, ref.var), rel(x.loglik, ref.loglik))
    # float32: checked per step (mean, var, logliks): the Posterior's float32 loglik is a float32
    # sum over T steps (make_posterior), whose own rounding grows with T
    check32 = (lambda x: rel(x, ref.loglik)) if what == "loglik" else (
        lambda x: max(rel(x.mean, ref.mean), rel(x.var, ref.var), rel(x.logliks, ref.logliks)))
    c = [("ks.filter cpu float64", public(y, "cpu"), check_post, "public call, NumPy in and out"),
         ("ks.filter cpu float32", public(y32, "cpu"), check32, "public call, float32 in and out")]
    if what == "loglik":
        def loglik_only():
            return ks.filter(y, backend="cpu", outputs=("loglik",), **kw).loglik

        c.append(("ks.filter cpu, outputs=loglik", loglik_only, check_post, "public call, log-likelihoods alone"))
    if what == "all":
        p = prepare(y, **kw)
        c.append(("cpu loop, mean+var only", lambda: cpu.filter(p, outputs=("mean", "var")),
                  lambda x: rel(x["var"].numpy(), ref.var), "validated problem, 2 outputs"))
        c.append(("memory floor: 10 outputs", lambda: write_outputs(y.shape, len(cpu.FIELDS)), lambda x: 0.0,
                  "allocate and fill the cpu backend's 10 float64 outputs (NumPy, one thread): no filter"))
    c.append(("ks.filter torch float64", public(y, "torch"), check_post, ""))
    c.append(("NumPy loop over time", lambda: numpy_loop(y, **kw),
              lambda x: max(rel(x["mean"], ref.mean), rel(x["var"], ref.var), rel(x["logliks"], ref.logliks)),
              "vectorised over series"))
    scale = 1
    if have["statsmodels"]:
        mod, params = statsmodels_models(y[:, :1], {**kw, "theta": kw["theta"][:1]})[0]
        scale = N
        c.append(("statsmodels loglike", lambda: mod.loglike(params), lambda x: rel(x, ref.loglik[0]),
                  "one series" + (f"; time x{N}, extrapolated" if N > 1 else "")))
    if have["simdkalman"] and what == "all" and N > 1:
        shared = ks.filter(y, backend="cpu", **{**kw, "theta": kw["theta"][0]})
        c.append(("simdkalman", lambda: simdkalman_filter(y, kw),
                  lambda x: rel(x.filtered.states.mean[..., 0].T, shared.mean),
                  "one rate for all series (checked against the cpu backend on the same)"))
    steps = min(T, SUBSET)
    decay, noise = ks.ou.discretize(kw["theta"][0], kw["sigma"], 1.0)
    one = (float(decay), float(noise), kw["obs_var"], float(ks.ou.stationary_var(kw["theta"][0], kw["sigma"])))
    extrapolate = {}
    for name, fn in (("filterpy", filterpy_filter), ("pykalman", pykalman_filter)):
        if have[name] and what == "all":
            extrapolate[name] = N * T / steps
            c.append((name, lambda fn=fn: fn(y[:steps, 0], *one), lambda x: rel(x, ref.mean[:steps, 0]),
                      f"one series of {steps} steps; time x{N * T / steps:g}, extrapolated"))
    rows = run_round_robin(c, repeat)
    for row in rows:
        if row["contender"] == "statsmodels loglike":
            row["seconds"] *= scale
            row["cpu_seconds"] *= scale
        if row["contender"] in extrapolate:
            row["seconds"] *= extrapolate[row["contender"]]
            row["cpu_seconds"] *= extrapolate[row["contender"]]
        row.update(N=N, T=T, what=what)
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run cpu``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", "--json", dest="out", help="write the rows and the machine to this file (JSON)")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    import numba

    have = {}
    for name in ("statsmodels", "simdkalman", "filterpy", "pykalman"):
        try:
            __import__(name)
            have[name] = True
        except ImportError:
            have[name] = False
    t0 = time.perf_counter()
    ks.filter(np.zeros((3, 2)), theta=1.0, sigma=1.0, obs_var=1.0, backend="cpu")
    first = time.perf_counter() - t0
    machine = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                   load_average=os.getloadavg(),
                   numba_threads=numba.get_num_threads(), torch_threads=torch.get_num_threads(),
                   numba=numba.__version__, torch=torch.__version__, numpy=np.__version__,
                   first_cpu_call_s=first, installed=have)
    print(f"numba {numba.__version__} threads {numba.get_num_threads()}, torch threads {torch.get_num_threads()}; "
          f"first cpu call in this process {first:.2f} s (cache load or compile); installed: {have}; "
          f"load average {os.getloadavg()[0]:.2f}")
    rows = []
    for N, T, what in (QUICK if args.quick else SHAPES) + [(None, None, "fit")]:
        shape_rows = fit_rows(args.repeat, have) if what == "fit" else bench_shape(N, T, what, args.repeat, have)
        N, T = shape_rows[0]["N"], shape_rows[0]["T"]
        base = shape_rows[0]["seconds"]
        kind = {"loglik": "log-likelihood", "fit": "local level fit, Nile"}.get(what, "all outputs")
        print(f"\n{N} series x {T} steps ({kind}), float64 data")
        print(f"  {'contender':28s} {'wall':>11s} {'vs cpu':>8s} {'cpu time':>11s} {'calls':>5s} "
              f"{'of it sys':>10s} {'max rel err':>11s}  note")
        for r in shape_rows:
            print(f"  {r['contender']:28s} {r['seconds'] * 1e3:9.1f}ms {r['seconds'] / base:7.2f}x "
                  f"{r['cpu_seconds'] * 1e3:9.1f}ms {r['calls']:5d} {r['sys_seconds'] * 1e3:8.1f}ms "
                  f"{r['max_rel_err']:11.1e}  {r['note']}")
        rows += shape_rows
    save(args.out, dict(machine=machine, rows=rows))


if __name__ == "__main__":
    main()
