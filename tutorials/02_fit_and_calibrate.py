"""Tutorial 2: fit the model's parameters, then check that its uncertainty is honest.

We estimate ``theta, sigma`` and ``obs_var`` per sensor by maximum likelihood (autograd
through the filter; missing values and irregular times enter the likelihood exactly), compare them
with the values that generated the data, and run the calibration report. Then we misstate the
sensor noise by a factor 4 either way and watch the report catch it, and say which way it is off.

    python tutorials/02_fit_and_calibrate.py [--out DIR]
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kalmanscan as ks  # noqa: E402


def main(out: Path):
    data = ks.datasets.sensors()
    y, times, truth, true = data.y, data.times, data.truth, data.params

    # 1. Maximum likelihood, one parameter set per sensor, with standard errors from the Hessian.
    # The mean level is fixed at each sensor's sample mean: a slowly reverting process pins its
    # mean down poorly (the temperature's correlation time 1/theta is 50 s in a 450 s record), and
    # estimating it as well (estimate=(..., "mean")) can leave a flat direction, reported as a NaN
    # standard error.
    fit = ks.fit(y, times=times, mean=np.nanmean(y, axis=0), estimate=("theta", "sigma", "obs_var"))
    print(fit)
    print("\nestimate vs truth, in standard errors:")
    for k in ("theta", "sigma", "obs_var"):
        z = (fit.params[k] - true[k]) / fit.stderr[k]
        print(f"  {k:<8}" + "  ".join(f"{name} {v:+.1f}" for name, v in zip(data.channels, z)))

    # 2. The fitted model's calibration: predictive checks on y, and NEES against the true state.
    post = fit.filter(y)
    good = ks.diagnostics.report(post, y, truth=truth)
    print("\nfitted model:")
    print(good)

    # 3. A misspecified model: sensor noise stated 4x too small (over-confident) and 4x too large.
    reports = {}
    for factor in (0.25, 4.0):
        wrong = fit.filter(y, obs_var=fit.params["obs_var"] * factor)
        reports[factor] = (wrong, ks.diagnostics.report(wrong, y, truth=truth))
        rep = reports[factor][1]
        print(f"\nobs_var x {factor:g}: {'calibrated' if rep.calibrated else 'NOT calibrated'}")
        for reason in rep.reasons:
            print(f"  - {reason}")
    assert good.calibrated and not any(r.calibrated for _, r in reports.values())

    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), layout="constrained")
    runs = [("fitted", post), ("obs_var x 0.25", reports[0.25][0]), ("obs_var x 4", reports[4.0][0])]
    for col, (label, p) in enumerate(runs):
        ks.plot.pit_histogram(p, y, ax=axes[0, col], title=f"PIT, {label}")
        ks.plot.reliability(p, y, target="obs", ax=axes[1, col], title=f"reliability of y, {label}")
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "02_calibration.png", dpi=110)
    plt.close(fig)
    print(f"\nwrote {out / '02_calibration.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tutorial-output"), help="folder for the figures")
    main(parser.parse_args().out)
