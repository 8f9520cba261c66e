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

from . import mobius, ou
from .filtering import filter
from .fit import fit
from .forecast import forecast
from .ops.filter import register_backend
from .posterior import Posterior
from .smooth import smooth
from .stream import StreamState
from .stream_filter import StreamFilter

__version__ = "0.1.0"

# Functions named like their modules are imported eagerly: importing a submodule binds it on the
# package, so a lazily bound ``ks.fit`` would become the module after ``import kalmanscan.fit``.
_LAZY = ("diagnostics", "plot", "nn", "datasets", "distributed", "xr", "ops")

__all__ = ["filter", "smooth", "fit", "forecast", "Posterior", "StreamState", "StreamFilter", "register_backend",
           "ou", "mobius", *_LAZY]


if "xarray" in sys.modules:
    from . import xr  # noqa: F401  (registers the ``.kalman`` accessor)


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'kalmanscan' has no attribute {name!r}")
