"""Scale out over processes: one long sequence split along time across the ranks of a group.

    import torch.distributed as dist
    import kalmanscan as ks
    dist.init_process_group("nccl")          # or "gloo" on CPUs; one process per GPU
    post = ks.distributed.filter(y_local, theta=0.1, sigma=1.0, obs_var=0.5)   # (..., T_local, C)
    y, y_var = ks.distributed.kla_scan(v, lam_v, k, q, decay, noise)           # (B, L_local, M)

Rank ``r`` holds the ``r``-th contiguous stretch of the sequence. Each rank summarises its stretch
by a carry-independent product (7 numbers per channel), one ``all_gather`` exchanges the
summaries, and each rank composes those of the ranks before it into its incoming state, then
runs its stretch locally from that state. Results equal the single-process ones to rounding.
Every function here is collective, and so is its backward. See docs/distributed.md.
"""

from __future__ import annotations

from kalmanscan.distributed.kla import kla_scan, reduce_gradients, sequence_parallel
from kalmanscan.distributed.series import filter, smooth

__all__ = ["filter", "smooth", "kla_scan", "sequence_parallel", "reduce_gradients"]
