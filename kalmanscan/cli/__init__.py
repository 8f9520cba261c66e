"""The ``kalmanscan`` command line: the entry point and its parser (:mod:`.main`), the commands
(:mod:`.commands`, :mod:`.demo`) and their inputs and model (:mod:`.inputs`), what they print and
draw (:mod:`.report`) and the files they read and write (:mod:`.io`)."""

from __future__ import annotations

from kalmanscan.cli.main import build_parser, main, print_fit

__all__ = ["main", "build_parser", "print_fit"]
