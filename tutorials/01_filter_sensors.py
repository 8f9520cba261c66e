"""Tutorial 1: filter a noisy multi-sensor series with gaps, and read its uncertainty.

Three sensors (temperature, pressure, level) are sampled at irregular times, each with its own
noise level, a long dropout and scattered missing values. We filter them with the OU model on
the GPU when there is one (the Triton kernels) and on the CPU otherwise, then read what the
filter says about how far to trust each estimate: the band, how it widens inside a gap, how much
each new observation moves the state (the write gate), and how smoothing narrows the band.

    python tutorials/01_filter_sensors.py [--out DIR]
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import xarray as xr  # noqa: E402

import kalmanscan as ks  # noqa: E402
import kalmanscan.xr  # noqa: E402,F401  (registers the .kalman accessor)


def longest_gap(missing):
    """(start, stop) of the longest run of True in ``missing``."""
    best, start = (0, 0), None
    for t, m in enumerate(np.append(missing, False)):
        if m and start is None:
            start = t
        elif not m and start is not None:
            best = max(best, (start, t), key=lambda r: r[1] - r[0])
            start = None
    return best


def main(out: Path):
    data = ks.datasets.sensors()                 # y: (T, 3) with NaN gaps; times: (T,) seconds
    p = data.params                              # the model that generated the data
    device = "cuda" if torch.cuda.is_available() else "cpu"
    y = torch.tensor(data.y, device=device)      # torch in -> torch out, on the same device
    times = torch.tensor(data.times, device=device)
    post = ks.filter(y, times=times, theta=p["theta"], sigma=p["sigma"], obs_var=p["obs_var"], mean=p["mean"])
    post = post.to_numpy()
    print(f"filtered {data.y.shape[0]} steps x {data.y.shape[1]} sensors on {device} "
          f"({'triton kernels' if device == 'cuda' else 'compiled cpu loops'})")

    # 1. The band: mean +- 1.96 sd is a 95% credible interval for the latent state.
    sd = post.std
    inside = np.abs(data.truth - post.mean) <= 1.96 * sd
    print("\nsensor        obs sd  typical state sd  95% band covers truth")
    for c, name in enumerate(data.channels):
        print(f"{name:<12}{np.sqrt(p['obs_var'][c]):>8.3f}{np.median(sd[:, c]):>18.3f}{inside[:, c].mean():>22.1%}")
    print("The state sd is below the sensor noise: the filter pools neighbouring readings.")

    # 2. Inside a gap the band widens: nothing new is learned, the OU prior diffuses.
    c = 0
    start, stop = longest_gap(np.isnan(data.y[:, c]))
    print(f"\n'{data.channels[c]}' has no data for t in [{data.times[start]:.0f}, {data.times[stop - 1]:.0f}] s:")
    print(f"  sd before the gap {sd[start - 1, c]:.3f}, at its end {sd[stop - 1, c]:.3f}, "
          f"stationary limit {np.sqrt(ks.ou.stationary_var(p['theta'][c], p['sigma'][c])):.3f}")

    # 3. The write gate (the Kalman gain): how much of each reading goes into the state.
    forget, write = post.gates()
    print(f"  write gate: median {np.median(write[:, c][write[:, c] > 0]):.2f}, "
          f"first reading after the gap {write[stop, c]:.2f} (the filter trusts it more)")

    # 4. Smoothing uses later readings as well: the band narrows most inside gaps.
    smoothed = ks.smooth(data.y, times=data.times, theta=p["theta"], sigma=p["sigma"], obs_var=p["obs_var"],
                         mean=p["mean"])
    mid = (start + stop) // 2
    print(f"  mid-gap sd: filtered {sd[mid, c]:.3f}, smoothed {smoothed.std[mid, c]:.3f}")

    # 5. The same with labels: a DataArray in, a Dataset with the band out.
    da = xr.DataArray(data.y, dims=("time", "sensor"),
                      coords={"time": data.times, "sensor": list(data.channels)}, attrs={"units": "a.u."})
    params = {k: xr.DataArray(p[k], dims="sensor", coords={"sensor": list(data.channels)})
              for k in ("theta", "sigma", "obs_var", "mean")}
    ds = da.kalman.smooth(**params, level=0.9)
    print(f"\nxarray: {list(ds.data_vars)[:6]} ...; loglik per sensor {np.round(ds['loglik'].values, 1)}")

    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), layout="constrained")
    for c, ax in enumerate(axes):
        ks.plot.belief_band(smoothed if c == 0 else post, y=data.y, times=data.times, channel=c, ax=ax,
                            truth=data.truth, title=f"{data.channels[c]}: "
                            f"{'smoothed' if c == 0 else 'filtered'} state, 95% band")
        ax.set_xlabel("time (s)")
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "01_sensors.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / '01_sensors.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tutorial-output"), help="folder for the figures")
    main(parser.parse_args().out)
