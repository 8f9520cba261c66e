"""A registry of an operation's backends: names to modules (or their import paths, imported on
first use). Each operation keeps one (:mod:`kalmanscan.ops.filter.dispatch`,
:mod:`kalmanscan.ops.kla.dispatch`); ``"auto"`` is never a registered name."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["Registry"]


class Registry:
    """Backends by name; the ones given at construction are built in and cannot be removed."""

    def __init__(self, built_in: dict[str, str | ModuleType]):
        self._modules = dict(built_in)
        self._built_in = tuple(built_in)
        # The names apart from the modules: a module imported on first use changes its entry, and
        # torch.compile, which guards what a traced check reads, would then trace the check again.
        self._names = tuple(built_in)

    def register(self, name: str, module: str | ModuleType) -> None:
        """Add (or replace) the backend ``name``."""
        if not isinstance(name, str) or not name or name == "auto":
            raise ValueError(f"name must be a non-empty string other than 'auto', got {name!r}")
        if not isinstance(module, (str, ModuleType)):
            raise ValueError(f"module must be a module or its import path, got {module!r}")
        self._modules[name] = module
        self._names = tuple(self._modules)

    def unregister(self, name: str) -> None:
        """Remove a backend added by :meth:`register` (the built-in ones stay)."""
        if name in self._built_in:
            raise ValueError(f"name: the built-in backend {name!r} cannot be removed")
        self._modules.pop(name, None)
        self._names = tuple(self._modules)

    def names(self) -> tuple[str, ...]:
        """``"auto"`` and every registered name."""
        return ("auto", *self._names)

    def known(self, name: str) -> str:
        """``name`` when it is registered; else ``ValueError`` naming ``backend`` (the one check of
        a backend's name)."""
        if name not in self._names:
            raise ValueError(f"backend must be one of {list(self.names())}, got {name!r}")
        return name

    def module(self, name: str) -> ModuleType:
        """The module of the backend ``name`` (imported on first use)."""
        module = self._modules[self.known(name)]
        if isinstance(module, str):  # kept once imported: torch.compile traces a lookup, not an import
            module = self._modules[name] = importlib.import_module(module)
        return module
