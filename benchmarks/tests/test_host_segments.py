"""``benchmarks.probes.host_segments``: the segments between a call's waits and the next call's
launches, from the times its stand-ins note (no GPU: a fake call notes them)."""

import time

import torch

from benchmarks.probes import host_segments


def test_segments_of_fake_calls(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def call():
        for name in ("agg", "fwd", "wait0", "wait1", "wait0", "wait1"):
            time.sleep(1e-4)
            host_segments.EVENTS.append((name, time.perf_counter()))

    out = host_segments.segments(call, idle=True, n=5)
    assert set(out) == {"to_agg", "to_fwd", "to_wait", "tail", "crit", "crit_fwd", "per_call"}
    assert 0 < out["to_agg"] < out["to_fwd"] < out["to_wait"] < out["per_call"]
    assert 0 < out["crit"] < out["crit_fwd"] < out["per_call"]
    assert out["tail"] > 0
