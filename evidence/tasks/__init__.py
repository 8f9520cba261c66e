"""Seeded task generators with disjoint train/test streams.

    make_task("a5", seq_len=64)                       # group word problems: a5, s5, a4xz5, z60
    make_task("mqar", seq_len=512, num_kv_pairs=64)   # Zoology-style MQAR
    make_task("fuzzy_recall")                          # the MAD suite at its baseline settings
    load_corpus()                                      # byte-level text: the Python stdlib's source
"""

from __future__ import annotations

from .base import IGNORE, Scores, Task, draw, split_of, split_rng, validation_set, train_batches
from .groups import GROUPS, group_task
from .mad import MAD_BASELINES, mad_task
from .mqar import mqar_task
from .text import TextCorpus, TrainWindows, eval_windows, load_corpus

TASKS = (*GROUPS, "mqar", *MAD_BASELINES)


def make_task(name: str, seq_len: int | None = None, **options) -> Task:
    """The task ``name`` (one of ``TASKS``).

    Group tasks need ``seq_len``; MQAR needs ``seq_len`` and takes ``num_kv_pairs``,
    ``vocab_size``, ``power_a``; MAD tasks use their baseline length unless ``seq_len`` is given
    (as MAD counts it) and take their generator's fields as ``options``.
    """
    if name in GROUPS:
        if seq_len is None:
            raise ValueError(f"seq_len is required for the group task {name!r}")
        return group_task(name, seq_len, **options)
    if name == "mqar":
        if seq_len is None:
            raise ValueError("seq_len is required for mqar")
        return mqar_task(seq_len, **options)
    if name in MAD_BASELINES:
        if seq_len is not None:
            options["seq_len"] = seq_len
        return mad_task(name, **options)
    raise ValueError(f"task must be one of {TASKS}, got {name!r}")


__all__ = [
    "IGNORE", "MAD_BASELINES", "Scores", "TASKS", "Task", "TextCorpus", "TrainWindows", "draw", "eval_windows",
    "load_corpus", "make_task", "split_of", "split_rng", "validation_set", "train_batches",
]
