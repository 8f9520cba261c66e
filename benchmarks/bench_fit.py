"""``ks.fit`` with standard errors on many series: wall time, iterations and device synchronisations.

Fits ``theta, sigma, obs_var`` per channel of simulated OU data (``N`` series x ``T`` steps, one
rate per series) on the default backend of the device (triton on CUDA, the compiled loop on the
CPU), after one warm-up fit (compilation). Prints, in one process:

* the fit's wall time (synchronised), its L-BFGS iterations, and the device synchronisations it
  made (CUDA's sync debug mode counts them);
* one objective evaluation alone (forward and backward of the log-likelihood), and the same
  through the public call ``ks.filter(...).loglik`` for comparison;
* the largest relative error of the estimates against the simulated truth, in standard errors.

::

    python -m benchmarks run fit [--device cuda] [--series 4096] [--steps 2048] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import kalmanscan as ks
from benchmarks.common import save, synchronisations
from kalmanscan.datasets import simulate
from kalmanscan.estimation.likelihood import Likelihood


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat=5):
    """Median wall time of ``fn()`` (synchronised) over ``repeat`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def count_syncs(fn, device):
    """``(result, synchronisations)`` of ``fn()`` (:func:`benchmarks.common.synchronisations`; ``None`` on a CPU)."""
    if device.type != "cuda":
        return fn(), None
    return synchronisations(fn)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks run fit``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--series", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", "--json", dest="out", help="write the results to this file (JSON)")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    N, T = args.series, args.steps
    rng = np.random.default_rng(0)
    truth = dict(theta=rng.uniform(0.05, 0.5, N), sigma=rng.uniform(0.5, 2.0, N), obs_var=rng.uniform(0.2, 1.0, N))
    _, y_np = simulate(T=T, seed=1, **truth)
    y = torch.tensor(y_np, dtype=dtype, device=device)

    def fit():
        return ks.fit(y, progress=False)

    fit()  # compilation, caches
    res, syncs = count_syncs(fit, device)
    wall = timed(fit, device, args.repeat)
    est = {k: res.params[k].double().cpu().numpy() for k in res.names}
    se = {k: res.stderr[k].double().cpu().numpy() for k in res.names}
    z = max(float(np.nanmax(np.abs(est[k] - truth[k]) / se[k])) for k in res.names)

    guess = {k: res.params[k].detach().clone() for k in res.names}
    lik = Likelihood(y, dict(mean=0.0), guess)

    def evaluation():
        leaves = {k: v.clone().requires_grad_(True) for k, v in guess.items()}
        (-lik(leaves).sum()).backward()

    def public():
        leaves = {k: v.clone().requires_grad_(True) for k, v in guess.items()}
        (-ks.filter(y, **leaves).loglik.sum()).backward()

    one, pub = timed(evaluation, device), timed(public, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"ks.fit on {name}: {N} series x {T} steps, {args.dtype}, theta/sigma/obs_var per series, with stderr")
    print(f"  fit (median of {args.repeat}) {wall * 1e3:9.1f} ms  iterations {res.n_iter}  "
          f"synchronisations {syncs if syncs is not None else 'n/a (cpu)'}  converged {res.converged}")
    print(f"  one objective evaluation  {one * 1e3:9.3f} ms (forward + backward, lean)")
    print(f"  ks.filter(...).loglik     {pub * 1e3:9.3f} ms (forward + backward, public call)")
    print(f"  worst |estimate - truth| / stderr over {N} series: {z:.2f}")
    save(args.out, dict(device=name, N=N, T=T, dtype=args.dtype, fit_s=wall, n_iter=res.n_iter, syncs=syncs,
                           evaluation_s=one, public_s=pub, converged=bool(res.converged), worst_z=z))


if __name__ == "__main__":
    main()
