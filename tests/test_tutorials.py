"""The tutorials run end to end (in process, Agg backend) and say what they claim to show."""

import runpy
import sys
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def _run(name, out, monkeypatch, capsys):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setattr(sys, "argv", [name, "--out", str(out)])
    runpy.run_path(str(TUTORIALS / name), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.parametrize("name, png, expected", [
    ("01_filter_sensors.py", "01_sensors.png", ["95% band covers truth", "mid-gap sd: filtered", "xarray:"]),
    ("02_fit_and_calibrate.py", "02_calibration.png",
     ["CalibrationReport: calibrated", "obs_var x 0.25: NOT calibrated", "under-dispersed",
      "obs_var x 4: NOT calibrated", "over-dispersed"]),
    ("03_forecast.py", "03_forecast.png", ["predictive interval of y covers", "random walk"]),
])
def test_tutorial_runs(name, png, expected, tmp_path, monkeypatch, capsys):
    out = _run(name, tmp_path, monkeypatch, capsys)
    for text in expected:
        assert text in out, text
    assert (tmp_path / png).stat().st_size > 30_000
