"""Type aliases used in annotations across the package.

``ArrayLike`` is anything a user may pass where an array is expected: a NumPy array, a torch
tensor, a Python number or sequence, or an xarray object. It is ``Any`` on purpose: the inputs
are converted at run time (:func:`kalmanscan.problem.prepare.prepare`), not checked statically.
"""

from __future__ import annotations

from typing import Any

ArrayLike = Any
"""A NumPy array, torch tensor, Python scalar or sequence, or xarray object."""

__all__ = ["ArrayLike"]
