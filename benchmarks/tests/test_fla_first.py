"""``benchmarks.fla_first``: under ``KALMANSCAN_FLA_FIRST_CONFIG=1`` fla is imported with
``triton.autotune`` keeping the first config, and ``triton.autotune`` is itself again afterwards."""

import sys

import pytest

from benchmarks import fla_first

FAKE_GLA = """
import triton
SEEN = triton.autotune(["a", "b", "c"], key=[])
"""


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """A stand-in ``fla.ops.gla`` whose import calls ``triton.autotune``, which records its configs."""
    triton = pytest.importorskip("triton")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "fla" / "ops").mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "gla.py").write_text(FAKE_GLA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(triton, "autotune", lambda configs, *a, **k: list(configs))
    yield triton
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_first_config_only_while_fla_is_imported(fake_fla, monkeypatch):
    original = fake_fla.autotune
    monkeypatch.setenv(fla_first.ENV, "1")
    assert fla_first.import_fla()
    assert sys.modules["fla.ops.gla"].SEEN == ["a"]
    assert fake_fla.autotune is original
    assert not fla_first.import_fla()  # fla imported already: nothing changes


def test_without_the_variable_fla_is_left_alone(fake_fla, monkeypatch):
    monkeypatch.delenv(fla_first.ENV, raising=False)
    assert not fla_first.import_fla()
    assert "fla" not in sys.modules
