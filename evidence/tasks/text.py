"""Byte-level language modelling on the Python standard library's source (vocabulary 256).

    corpus = load_corpus()                      # every .py file of this interpreter's stdlib
    windows = TrainWindows(corpus.train, seed=0, batch=16, seq_len=2048)
    batch = windows.at(step)                    # (16, 2049) uint8: inputs [:, :-1], targets [:, 1:]
    x, y = eval_windows(corpus.test, 2048, max_bytes=2 ** 18)

The corpus is every ``.py`` file under ``os.path.dirname(os.__file__)`` of the running
interpreter, recursively, without third-party packages (``site-packages``, ``dist-packages``):
text that every machine has and that nobody here wrote. Files are split, not bytes: the sha256 of
a file's relative path (POSIX separators) decides whether it is held out (``HELD_OUT_PERCENT``
of 100 buckets), so no file is in both splits and the split does not depend on what else is in the
directory. Each split is its files' bytes in sorted path order, each file followed by
``SEPARATOR``. A result is comparable only with results of the same corpus: :func:`corpus_info`
records the interpreter version, the bytes and files per split and a hash of the file list.

Training windows are drawn with replacement from the train split by a generator seeded by
``(seed, step)``, so a resumed run sees exactly the batches an uninterrupted one would.
Evaluation windows are fixed and do not overlap: each target byte of the held-out split is scored
once (the first byte of the split, which has no context, is not scored).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from dataclasses import dataclass

import numpy as np

from .base import IGNORE

VOCAB_SIZE = 256
SEPARATOR = 0                  # NUL: between files (Python source never contains it)
HELD_OUT_PERCENT = 5           # files whose path hash falls in these of 100 buckets are held out
EXCLUDED_DIRS = ("site-packages", "dist-packages")


def stdlib_root() -> str:
    """The directory of the running interpreter's standard library."""
    return os.path.dirname(os.__file__)


def corpus_files(root: str) -> list:
    """Sorted relative paths (POSIX separators) of every ``.py`` file under ``root``, recursively,
    skipping the directories named in ``EXCLUDED_DIRS``. A ``ValueError`` if there is none."""
    if not os.path.isdir(root):
        raise ValueError(f"root must be a directory, got {root!r}")
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        rel = os.path.relpath(here, root)
        for name in files:
            if name.endswith(".py"):
                found.append(name if rel == "." else os.path.join(rel, name).replace(os.sep, "/"))
    if not found:
        raise ValueError(f"root {root!r} holds no .py files")
    return sorted(found)


def is_held_out(path: str) -> bool:
    """Whether the file at relative ``path`` belongs to the held-out split (a stable hash of the path)."""
    bucket = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little") % 100
    return bucket < HELD_OUT_PERCENT


@dataclass(frozen=True)
class TextCorpus:
    """The two splits as uint8 arrays (files concatenated, each followed by ``SEPARATOR``) and
    :func:`corpus_info`'s record."""

    train: np.ndarray
    test: np.ndarray
    info: dict


def load_corpus(root: str | None = None) -> TextCorpus:
    """Read the corpus under ``root`` (default: :func:`stdlib_root`). A ``ValueError`` when a split
    is empty."""
    root = stdlib_root() if root is None else root
    paths = corpus_files(root)
    parts = {"train": [], "test": []}
    for path in paths:
        with open(os.path.join(root, path), "rb") as fh:
            parts["test" if is_held_out(path) else "train"].append(fh.read() + bytes([SEPARATOR]))
    for split, chunks in parts.items():
        if not chunks:
            raise ValueError(f"root {root!r}: the {split} split has no files ({len(paths)} files in all)")
    train, test = (np.frombuffer(b"".join(parts[s]), dtype=np.uint8) for s in ("train", "test"))
    return TextCorpus(train, test, corpus_info(paths, train, test, len(parts["test"])))


def corpus_info(paths: list, train: np.ndarray, test: np.ndarray, test_files: int) -> dict:
    """What makes a corpus reproducible: interpreter, bytes and files per split, and the sha256
    of the sorted relative paths joined by newlines."""
    return {
        "source": "python stdlib .py files",
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "files": {"train": len(paths) - test_files, "test": test_files},
        "bytes": {"train": int(train.size), "test": int(test.size)},
        "file_list_sha256": hashlib.sha256("\n".join(paths).encode()).hexdigest(),
        "held_out_percent": HELD_OUT_PERCENT,
    }


class TrainWindows:
    """Random training windows of ``seq_len + 1`` bytes of ``data``, batch ``step`` a function of
    ``(seed, step)`` alone.

    ``at(step)`` -> uint8 ``(batch, seq_len + 1)``; inputs are ``[:, :-1]``, targets ``[:, 1:]``.
    ``state_dict``/``load_state_dict`` exist for :mod:`evidence.checkpoint` and hold nothing: the
    step is the stream's whole position.
    """

    def __init__(self, data: np.ndarray, seed: int, batch: int, seq_len: int):
        if data.ndim != 1 or data.size < seq_len + 1:
            raise ValueError(f"data must be 1-D with at least seq_len + 1 = {seq_len + 1} bytes, got {data.shape}")
        self.data, self.seed, self.batch, self.seq_len = data, int(seed), batch, seq_len
        self.offsets = np.arange(seq_len + 1)

    def at(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(step)])
        starts = rng.integers(0, self.data.size - self.seq_len, size=self.batch)
        return self.data[starts[:, None] + self.offsets]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"state: TrainWindows keeps no state, got keys {sorted(state)}")


def eval_windows(data: np.ndarray, seq_len: int, max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fixed, non-overlapping evaluation windows: ``(x, y)`` int64 ``(n, seq_len)``.

    Window ``i`` reads ``data[i*seq_len : (i+1)*seq_len]`` and is scored on the byte after each
    position, so every byte after the first is a target exactly once; the last window is padded
    with ``IGNORE`` targets (and zero inputs). ``max_bytes``: at most ``max_bytes // seq_len``
    windows (at least one), evenly spaced over the split.
    """
    n_targets = data.size - 1
    if n_targets < 1:
        raise ValueError(f"data must hold at least 2 bytes, got {data.size}")
    n = -(-n_targets // seq_len)
    padded = np.zeros(n * seq_len + 1, dtype=np.int64)
    padded[: data.size] = data
    x = padded[:-1].reshape(n, seq_len)
    y = padded[1:].reshape(n, seq_len).copy()
    y.reshape(-1)[n_targets:] = IGNORE
    if max_bytes is not None and n > max(1, max_bytes // seq_len):
        keep = np.unique(np.linspace(0, n - 1, max(1, max_bytes // seq_len)).round().astype(np.int64))
        x, y = x[keep], y[keep]
    return x, y
