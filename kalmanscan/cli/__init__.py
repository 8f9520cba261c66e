"""The ``kalmanscan`` command line: the commands (:mod:`.main`), what they print and draw
(:mod:`.report`) and the files they read and write (:mod:`.io`)."""

from __future__ import annotations

from kalmanscan.cli.main import build_parser, main, print_fit

__all__ = ["main", "build_parser", "print_fit"]
