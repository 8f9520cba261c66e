"""The launch overrides the KLA benchmarks take (``kla_pieces --configs``, ``bench_model``'s
``kla@...`` variants): parsed as written, applied to the scan's launch inside the context only."""

import pytest
import torch

from benchmarks.bench_model import scan_variant, variant_changes
from benchmarks.common import launched_with, overrides
from kalmanscan.ops.kla.triton import backend as kla_triton
from kalmanscan.ops.kla.triton.library import SPLIT_CONFIG


def test_overrides_parse_ints_booleans_and_none():
    assert overrides("-") == {}
    assert overrides("stages=1, bwd_pieces=none,even=TRUE,variance=false") == dict(
        stages=1, bwd_pieces=None, even=True, variance=False)


def test_launched_with_changes_the_launch_and_restores_it():
    cpu = torch.device("cpu")
    before = kla_triton.launch_config(1, 64, 8, cpu)
    assert before == SPLIT_CONFIG
    with launched_with(bwd_per_sm=16, unroll=2):
        inside = kla_triton.launch_config(1, 64, 8, cpu)
    assert (inside.bwd_per_sm, inside.unroll, inside.block_m) == (16, 2, SPLIT_CONFIG.block_m)
    assert kla_triton.launch_config(1, 64, 8, cpu) == before


def test_model_variants_name_their_changes():
    cpu = torch.device("cpu")
    with scan_variant("kla@bwd_per_sm=12+even=true"):
        inside = kla_triton.launch_config(1, 64, 8, cpu)
    assert (inside.bwd_per_sm, inside.even) == (12, True)
    with scan_variant("kla_even"):
        assert kla_triton.launch_config(1, 64, 8, cpu).even
    with scan_variant("kla"):
        assert kla_triton.launch_config(1, 64, 8, cpu) == SPLIT_CONFIG


def test_misspelt_variants_are_refused():
    assert variant_changes("attention") == {} and variant_changes("kla_y_var") == {}
    assert variant_changes("kla@bwd_per_sm=8") == dict(bwd_per_sm=8)
    for name in ("kla_evne", "kla@", "kla@no_such_field=1", "kla2"):
        with pytest.raises(ValueError, match="mixer"):
            variant_changes(name)
