"""A record several times a worker's memory limit, chunked along time, filtered and smoothed on a
local dask cluster (``da.kalman.filter/smooth`` through :mod:`kalmanscan.xr.timechunks`), written to
a Zarr store chunk by chunk; beside it the in-memory call on a slice that fits.

Prints and writes (``--out``): the record's bytes against the workers' limit, wall time and
throughput (steps x channels per second) of the chunked filter and smoother and of the in-memory
filter on the same machine, the peak memory of the workers (sampled by ``distributed``), whether
any worker was lost, and the largest relative difference from the in-memory result on
``--check`` channels.

    python -m benchmarks run timechunks --out timechunks.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from benchmarks.common import commit, save

__all__ = ["parser", "main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-limit", default="400MiB", help="each worker's limit (dask's memory_limit)")
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--steps", type=int, default=2_000_000)
    p.add_argument("--chunk-steps", type=int, default=20_000)
    p.add_argument("--check", type=int, default=2, help="channels compared with the in-memory call")
    p.add_argument("--ops", default="filter,smooth", help="comma list of the operations run, from filter, smooth")
    p.add_argument("--out", default=None, help="JSON file for the results")
    return p


def _record(channels: int, steps: int, chunk_steps: int):
    import dask.array as dsa
    import xarray as xr

    rng = dsa.random.default_rng(0)
    walk = rng.normal(size=(steps, channels), chunks=(chunk_steps, channels)).cumsum(axis=0) * 0.05
    y = walk + rng.normal(size=(steps, channels), chunks=(chunk_steps, channels))
    return xr.DataArray(y, dims=("time", "channel"), name="y")


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    ops = tuple(op.strip() for op in args.ops.split(","))
    if not ops or set(ops) - {"filter", "smooth"}:
        raise ValueError(f"--ops must name filter and/or smooth, got {args.ops!r}")
    import dask
    import xarray as xr
    from dask.distributed import Client, LocalCluster
    from dask.distributed.diagnostics import MemorySampler
    from dask.utils import parse_bytes

    import kalmanscan as ks
    import kalmanscan.xr  # noqa: F401  (the .kalman accessor)

    kw = dict(theta=0.01, sigma=0.05, obs_var=1.0)
    da = _record(args.channels, args.steps, args.chunk_steps)
    limit = parse_bytes(args.memory_limit)
    result = dict(commit=commit(), record_bytes=da.nbytes, worker_limit_bytes=limit, workers=args.workers,
                  ratio=da.nbytes / limit, shape=list(da.shape), chunk_steps=args.chunk_steps, rows=[])
    print(f"record {da.nbytes / 2**30:.2f} GiB = {da.nbytes / limit:.1f} x a worker's limit of "
          f"{limit / 2**20:.0f} MiB, {args.workers} workers")
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, memory_limit=limit,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        record = os.path.join(tmp, "record.zarr")       # a record longer than memory lives on disk
        da.to_dataset().to_zarr(record, mode="w")
        da = xr.open_zarr(record)["y"]
        sampler = MemorySampler()
        for op in ops:
            workers = set(client.scheduler_info()["workers"])
            path = os.path.join(tmp, f"{op}.zarr")
            ds = getattr(da.kalman, op)(dim="time", **kw)[["mean", "var", "loglik"]]
            start = time.perf_counter()
            with sampler.sample(op, measure="process"):
                ds.to_zarr(path, mode="w")
            seconds = time.perf_counter() - start
            lost = sorted(workers - set(client.scheduler_info()["workers"]))
            peak = float(sampler.to_pandas()[op].max())
            row = dict(op=op, seconds=seconds, per_s=da.size / seconds, peak_workers_bytes=peak,
                       workers_lost=len(lost))
            small = da.isel(channel=slice(0, args.check)).compute(scheduler="sync")
            eager = getattr(ks, op)(small.values, **kw)
            got = xr.open_zarr(path).isel(channel=slice(0, args.check))
            row["max_rel_err"] = max(
                float(np.max(np.abs(got[k].values - ref) / np.maximum(np.abs(ref), 1e-300)))
                for k, ref in (("mean", eager.mean), ("var", eager.var), ("loglik", eager.loglik)))
            result["rows"].append(row)
            print(f"{op:7s} {seconds:7.1f} s  {row['per_s'] / 1e6:6.1f} M steps x channels/s  peak workers "
                  f"{peak / 2**20:7.0f} MiB (limit {args.workers} x {limit / 2**20:.0f})  lost {len(lost)}  "
                  f"max rel err {row['max_rel_err']:.1e}")
            save(args.out, result)
    fits = _record(args.channels, args.steps, args.chunk_steps).isel(channel=slice(0, max(1, args.channels // 8)))
    fits = fits.compute(scheduler="sync").values
    with dask.config.set(scheduler="sync"):
        start = time.perf_counter()
        ks.filter(fits, **kw, outputs=("mean", "var", "loglik"))
        seconds = time.perf_counter() - start
    result["in_memory_filter_per_s"] = fits.size / seconds
    print(f"in-memory ks.filter (mean, var, loglik) on {fits.shape}: {fits.size / seconds / 1e6:.1f} M/s")
    save(args.out, result)
    return result


if __name__ == "__main__":
    main()
