"""The launch wrappers' host-side integer helpers equal Triton's (which cost ~2 µs a call from Python)."""

import triton

from kalmanscan.ops.launch import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_equal_tritons():
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 40))
    assert cdiv(2**40 + 1, 2**20) == 2**20 + 1
    assert all(next_power_of_2(n) == triton.next_power_of_2(n) for n in range(0, 5000))
    assert next_power_of_2(2**40 + 1) == 2**41
