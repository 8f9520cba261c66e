"""kalmanscan: parallel diagonal Kalman filtering with honest uncertainty, and the KLA layer.

    import kalmanscan as ks
    post = ks.filter(y, theta=0.1, sigma=1.0, obs_var=0.5)   # y: (..., T, C), NaN = missing
    post.mean, post.var, post.loglik

Every public name is imported on first use (PEP 562): ``import kalmanscan`` loads neither torch
nor numba, so the command line starts at once; the first use of ``ks.filter`` (or any name in
``__all__``) imports the library (torch included, never torch's compiler). On the CPU small
float64 problems run without numba (:mod:`kalmanscan.ops.filter.cpu.small`, the compiled loops'
bits), so a process's first call takes milliseconds; larger ones load the compiled loops from
numba's on-disk cache (its start costs about 0.4 s once). ``ks.xr`` (``import kalmanscan.xr``)
registers the ``.kalman`` accessor on ``xarray.DataArray``; it is registered at import when xarray
is already loaded. ``import kalmanscan.nn`` imports neither xarray, pandas nor matplotlib.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public names -> the module that defines them.
_NAMES = {"filter": "kalmanscan.inference.filtering", "smooth": "kalmanscan.inference.smoothing",
          "fit": "kalmanscan.estimation.fitting", "forecast": "kalmanscan.inference.forecasting",
          "Posterior": "kalmanscan.inference.posterior", "StreamState": "kalmanscan.inference.state",
          "StreamFilter": "kalmanscan.inference.stream_filter", "register_backend": "kalmanscan.ops.filter"}
# Sub-packages and modules, by the name they have on ``ks``.
_MODULES = {"diagnostics": "kalmanscan.diagnostics", "plot": "kalmanscan.diagnostics.plot", "nn": "kalmanscan.nn",
            "datasets": "kalmanscan.datasets", "distributed": "kalmanscan.distributed", "xr": "kalmanscan.xr",
            "ops": "kalmanscan.ops", "ou": "kalmanscan.model.ou", "mobius": "kalmanscan.model.mobius",
            "tuning": "kalmanscan.tuning"}

__all__ = ["filter", "smooth", "fit", "forecast", "Posterior", "StreamState", "StreamFilter", "register_backend",
           "diagnostics", "plot", "nn", "datasets", "distributed", "xr", "ops", "ou", "mobius", "tuning"]

if TYPE_CHECKING:
    from kalmanscan.estimation.fitting import fit
    from kalmanscan.inference.filtering import filter
    from kalmanscan.inference.forecasting import forecast
    from kalmanscan.inference.posterior import Posterior
    from kalmanscan.inference.smoothing import smooth
    from kalmanscan.inference.state import StreamState
    from kalmanscan.inference.stream_filter import StreamFilter
    from kalmanscan.ops.filter import register_backend

if "xarray" in sys.modules:
    from kalmanscan import xr  # noqa: F401  (registers the ``.kalman`` accessor)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'kalmanscan' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
