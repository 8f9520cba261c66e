"""The reach probe: the gradient of a mixer's last output on each earlier input, by lag."""

import json

import numpy as np
import pytest
import torch

from evidence import reach


def test_lags():
    assert reach.lags(2048) == [0, 1, 4, 16, 64, 256, 1024, 2047]
    assert reach.lags(2) == [0, 1] and reach.lags(5) == [0, 1, 4]


def test_reach_is_the_gradient_by_lag():
    """A causal layer whose output at t is x[t] + 0.5 x[t-1]: the gradient of |y[-1]|^2 on the
    inputs is 2 y[-1] at lag 0, y[-1] at lag 1 and zero beyond."""

    class Lag1(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return x + self.w * torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]

    norms = reach.reach(Lag1(), 3, 6, batch=2)
    assert norms.shape == (6,)
    assert norms[1] == pytest.approx(0.5 * norms[0]) and np.all(norms[2:] == 0)


def test_cli_on_gla_and_kla(tmp_path):
    out = reach.main(["--mixers", "gla_conv_k2", "kla", "--len", "33", "--d-model", "16", "--out",
                      str(tmp_path / "r.json")])
    assert [r["mixer"] for r in out["rows"]] == ["gla_conv_k2", "kla"]
    for row in out["rows"]:
        assert row["lags"] == [0, 1, 4, 16, 32] and row["relative"][0] == 1.0
        assert all(r >= 0 for r in row["relative"]) and 0 <= row["longest_nonzero_lag"] <= 32
    assert json.loads((tmp_path / "r.json").read_text())["length"] == 33


def test_unknown_or_composite_spec_is_refused():
    with pytest.raises(ValueError, match="unknown spec"):
        reach.mixer_from_spec("nope", 16)
    with pytest.raises(ValueError, match="more than the mixer"):
        reach.mixer_from_spec("kla_noise0", 16)
    with pytest.raises(ValueError, match="weight_init"):
        reach.mixer_from_spec("kla", 16, weight_init="xavier")


def test_layer_is_initialised_as_the_harness_does():
    torch.manual_seed(0)
    normal = reach.mixer_from_spec("gla", 64)
    own = reach.mixer_from_spec("gla", 64, weight_init="torch")
    linears = [m.weight for m in normal.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and max(float(w.std()) for w in linears) < 0.03      # N(0, 0.02^2)
    assert max(float(m.weight.std()) for m in own.modules() if isinstance(m, torch.nn.Linear)) > 0.05


def test_slower_gate_hears_further():
    """``gla_conv_k2_g256`` is ``gla_conv_k2`` with its log decay divided by 256, not 16: at
    initialisation its last output depends more on the far inputs (T = 256, the same weights)."""
    torch.manual_seed(0)
    fast = reach.mixer_from_spec("gla_conv_k2", 32)
    torch.manual_seed(0)
    slow = reach.mixer_from_spec("gla_conv_k2_g256", 32)
    assert (fast.gate_normalizer, slow.gate_normalizer) == (16.0, 256.0)
    far = [reach.reach(m, 32, 256)[-1] / reach.reach(m, 32, 256)[0] for m in (fast, slow)]
    assert far[1] > 100 * far[0]
