"""Tutorial 3: forecast with honest intervals, and check them on held-out data.

Part 1 fits the local-level model (a random walk, ``theta = 0``, observed with noise) to the Nile
flow of 1871-1950, forecasts 1951-1970, and counts how many held-out years fall inside the
predictive intervals. Part 2 forecasts the sensors of tutorial 1 to irregular future times: an OU
state forgets, so its forecast variance levels off at the stationary variance, while the random
walk's keeps growing.

    python tutorials/03_forecast.py [--out DIR]
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kalmanscan as ks  # noqa: E402


def main(out: Path):
    nile = ks.datasets.load_nile()                    # y: (100, 1), years 1871..1970
    split = 80
    y, future = nile.y[:split], nile.y[split:]

    # 1. Fit the local level on the first 80 years (the exact diffuse start: init_var = inf).
    fit = ks.fit(y, times=nile.times[:split], theta=0.0, init_var=float("inf"),
                 estimate=("sigma", "obs_var"))
    print(f"local level fitted on 1871-{int(nile.times[split - 1])}: level sd per year "
          f"{fit.params['sigma'][0]:.1f}, observation sd {np.sqrt(fit.params['obs_var'][0]):.1f}")

    # 2. Forecast the next 20 years from the end of the filter run.
    post = fit.filter(y)
    fc = ks.forecast(post, steps=len(future))
    for level in (0.8, 0.95):
        lo, hi = fc.interval(level, of="obs")
        inside = (future >= lo) & (future <= hi)
        print(f"  {level:.0%} predictive interval of y covers {inside.sum()} of {len(future)} held-out years")
    print(f"  forecast sd of y: {fc.obs_std[0, 0]:.0f} one year ahead, {fc.obs_std[-1, 0]:.0f} twenty years ahead")

    # 3. Irregular future times: the three sensors, 1 to 300 s past their last reading.
    data = ks.datasets.sensors()
    p = data.params
    spost = ks.filter(data.y, times=data.times, theta=p["theta"], sigma=p["sigma"], obs_var=p["obs_var"],
                      mean=p["mean"])
    lead = np.array([1.0, 3.0, 10.0, 30.0, 100.0, 300.0])
    sfc = ks.forecast(spost, times=data.times[-1] + lead)
    walk = ks.forecast(ks.filter(data.y, times=data.times, theta=0.0, sigma=p["sigma"], obs_var=p["obs_var"],
                                 init_var=10.0), times=data.times[-1] + lead)
    stationary = np.sqrt(ks.ou.stationary_var(p["theta"], p["sigma"]))
    print(f"\n'{data.channels[2]}' state forecast sd by lead time (stationary sd {stationary[2]:.2f}):")
    print("  lead (s)   OU     random walk")
    for k, L in enumerate(lead):
        print(f"  {L:>8g}{sfc.std[k, 2]:>7.2f}{walk.std[k, 2]:>12.2f}")

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
    ax = axes[0]
    ks.plot.belief_band(post, y=y, times=nile.times[:split], ax=ax, title="Nile: filtered level and forecast")
    for level, alpha in ((0.95, 0.15), (0.8, 0.3)):
        lo, hi = fc.interval(level, of="obs")
        ax.fill_between(nile.times[split:], lo[:, 0], hi[:, 0], color="C1", alpha=alpha, lw=0,
                        label=f"{level:.0%} forecast of y")
    ax.plot(nile.times[split:], fc.obs_mean[:, 0], color="C1", lw=1.5)
    ax.plot(nile.times[split:], future[:, 0], "x", color="k", ms=5, label="held out")
    ax.set_xlabel("year")
    ax.legend(loc="lower left", fontsize="small", ncol=2)
    ax = axes[1]
    ax.plot(lead, sfc.std[:, 2], "o-", label="OU (theta = %.2g)" % p["theta"][2])
    ax.plot(lead, walk.std[:, 2], "s-", label="random walk")
    ax.axhline(stationary[2], color="k", ls=":", lw=1, label="OU stationary sd")
    ax.set_xscale("log")
    ax.set_xlabel("lead time (s)")
    ax.set_ylabel("forecast sd of the state")
    ax.set_title(f"'{data.channels[2]}': forecast uncertainty by lead time")
    ax.legend(fontsize="small")
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "03_forecast.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / '03_forecast.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tutorial-output"), help="folder for the figures")
    main(parser.parse_args().out)
