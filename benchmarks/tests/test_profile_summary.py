"""``benchmarks.probes.profile_kernels --summary`` on a recorded Nsight Compute raw CSV (no GPU needed):
``data/ncu_filter_forward_raw.csv``, ``ncu --page raw --csv`` over ``python -m benchmarks.probes.profile_kernels
filter`` on an H200 (the filter's forward at (4096, 32768) and (1, 2^22), and a forward since removed)."""

import os

from benchmarks.probes import profile_kernels

RAW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ncu_filter_forward_raw.csv")


def test_summary_of_recorded_profile():
    lines = profile_kernels.summary(RAW).splitlines()
    names = [line.split()[0] for line in lines]
    assert len(names) == 7                                    # torch's own kernels left out
    assert names[:6] == ["filter_agg_kernel", "filter_carry_kernel", "filter_fwd_kernel",
                         "filter_tile_agg_kernel", "filter_carry_kernel", "filter_tile_fwd_kernel"]
    # (the seventh is the since-removed chained forward's kernel, profiled in the same run)
    apply = lines[2]
    assert "| us 420 |" in apply and "| DRAM % 78.6 |" in apply and "| L2 hit % 67.9 |" in apply
    assert "stalls long_scoreboard 16.08," in apply and apply.endswith("of 18.07")
