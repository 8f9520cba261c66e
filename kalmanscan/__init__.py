"""kalmanscan: parallel diagonal Kalman filtering with honest uncertainty, and the KLA layer.

    import kalmanscan as ks
    post = ks.filter(y, theta=0.1, sigma=1.0, obs_var=0.5)   # y: (..., T, C), NaN = missing
    post.mean, post.var, post.loglik

Submodules loaded on first use: the toolkit and layer modules listed in ``__all__``. ``ks.xr``
(``import kalmanscan.xr``) registers the ``.kalman`` accessor on ``xarray.DataArray``; it is
registered at import when xarray is already loaded. ``import kalmanscan.nn`` imports neither
xarray, pandas nor matplotlib.
"""

from __future__ import annotations

import importlib
import sys

from kalmanscan.model import mobius, ou
from kalmanscan.inference.filtering import filter
from kalmanscan.estimation.fitting import fit
from kalmanscan.inference.forecasting import forecast
from kalmanscan.ops.filter import register_backend
from kalmanscan.inference.posterior import Posterior
from kalmanscan.inference.smoothing import smooth
from kalmanscan.inference.stream import StreamState
from kalmanscan.inference.stream_filter import StreamFilter

__version__ = "0.1.0"

# Sub-packages imported on first use, by the name they have on ``ks``.
_LAZY = {"diagnostics": "kalmanscan.diagnostics", "plot": "kalmanscan.diagnostics.plot", "nn": "kalmanscan.nn",
         "datasets": "kalmanscan.datasets", "distributed": "kalmanscan.distributed", "xr": "kalmanscan.xr",
         "ops": "kalmanscan.ops"}

__all__ = ["filter", "smooth", "fit", "forecast", "Posterior", "StreamState", "StreamFilter", "register_backend",
           "ou", "mobius", *_LAZY]


if "xarray" in sys.modules:
    from kalmanscan import xr  # noqa: F401  (registers the ``.kalman`` accessor)


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'kalmanscan' has no attribute {name!r}")
