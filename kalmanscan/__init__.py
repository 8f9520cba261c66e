"""kalmanscan: parallel diagonal Kalman filtering with honest uncertainty, and the KLA layer.

    import kalmanscan as ks
    post = ks.filter(y, theta=0.1, sigma=1.0, obs_var=0.5)   # y: (..., T, C), NaN = missing
    post.mean, post.var, post.loglik

Submodules loaded on first use: ``ks.ou`` (OU discretisation), ``ks.mobius`` (the scan algebra),
and the toolkit and layer modules listed in ``__all__``.
"""

from __future__ import annotations

import importlib

from . import mobius, ou
from .filtering import filter
from .fit import fit
from .forecast import forecast
from .posterior import Posterior
from .smooth import smooth
from . import xr  # registers the ``.kalman`` accessor on xarray.DataArray

__version__ = "0.1.0"

# Functions named like their modules are imported eagerly: importing a submodule binds it on the
# package, so a lazily bound ``ks.fit`` would become the module after ``import kalmanscan.fit``.
_LAZY = ("diagnostics", "plot", "nn", "datasets", "distributed")

__all__ = ["filter", "smooth", "fit", "forecast", "Posterior", "ou", "mobius", "xr", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'kalmanscan' has no attribute {name!r}")
