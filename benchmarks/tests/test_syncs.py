"""benchmarks.common.synchronisations: what it counts as a device synchronisation (checked without
CUDA: torch's sync debug mode and CUDA events stubbed)."""

import warnings
from unittest import mock

import torch

from benchmarks import common


def test_counts_sync_warnings_and_event_waits_not_the_prototype_notice():
    """torch warns once per process that its sync debug mode is a prototype; that notice names
    "synchronizing operations" but is not a synchronisation (it made the first of several measured
    calls count one more)."""

    def set_mode(mode):
        if mode == "warn":
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations")

    def call():
        warnings.warn(common.SYNC_WARNING)
        torch.cuda.Event.synchronize(object())
        torch.cuda.Event.synchronize(object())
        return "done"

    with mock.patch.object(torch.cuda, "set_sync_debug_mode", set_mode), \
            mock.patch.object(torch.cuda.Event, "synchronize", lambda event: None):
        assert common.synchronisations(call) == ("done", 3)
        assert common.synchronisations(lambda: None) == (None, 0)
