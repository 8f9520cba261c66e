"""Multi-query associative recall (MQAR), in the style of the Zoology benchmark.

A sequence of length ``seq_len`` starts with a context of ``num_kv_pairs`` pairs ``k_1 v_1 k_2 v_2
...``: keys are distinct and drawn from ``[1, vocab_size // 2)``, values distinct and drawn from
``[vocab_size // 2, vocab_size)`` (disjoint halves; token 0 is never a key). After the context,
every key is asked once: it appears again at an even offset ``2 * slot`` past the context, where
the ``num_kv_pairs`` distinct slots among ``(seq_len - 2 * num_kv_pairs) // 2`` are drawn without
replacement with weights ``p(i) ~ i ** (power_a - 1)`` (i = 1, 2, ...): a power law that puts
most queries soon after the context. The label at a query's position is its value (the next
token); every other position is ``IGNORE``. Positions that are neither context nor query hold
``filler``: ``"zero"`` puts token 0 there (never a key or value), as the Zoology paper's
configurations do (``random_non_queries=False``); ``"random"`` puts uniform random tokens of the
whole vocabulary there (Zoology's generator default).

Example (``seq_len=16, num_kv_pairs=3, vocab_size=16, power_a=0.5, filler="zero"``, seed 3;
``.`` is ``IGNORE``)::

    position  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    inputs    1 10  5  8  2 11  0  0  1  0  2  0  0  0  5  0
    targets   .  .  .  .  .  .  .  . 10  . 11  .  .  .  8  .

The model's output at position ``t`` is scored against ``targets[t]`` (no further shift): at a
query the next token is the key's value, which the inputs never show after the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import IGNORE, Task


def power_law_slots(rng: np.random.Generator, n: int, space: int, k: int, power_a: float):
    """``(n, k)`` distinct slots in ``[0, space)`` per row, weighted ``(slot + 1) ** (power_a - 1)``.

    Sampling without replacement by the Gumbel top-k trick (exact for successive weighted draws).
    """
    if not 0 < power_a <= 1:
        raise ValueError(f"power_a must lie in (0, 1], got {power_a}")
    if k > space:
        raise ValueError(f"cannot place {k} queries in {space} slots")
    logw = (power_a - 1.0) * np.log(np.arange(1, space + 1, dtype=np.float64))
    keys = logw[None, :] + rng.gumbel(size=(n, space))
    return np.argpartition(-keys, k - 1, axis=1)[:, :k]


def distinct_draws(rng: np.random.Generator, n: int, low: int, high: int, k: int) -> np.ndarray:
    """``(n, k)`` distinct integers per row from ``[low, high)``, uniformly (random permutation prefix)."""
    return np.argsort(rng.random((n, high - low)), axis=1)[:, :k] + low


@dataclass(frozen=True)
class MQARTask(Task):
    """MQAR with ``num_kv_pairs`` pairs; scored positions are the queries (labels = values)."""

    num_kv_pairs: int = 64
    power_a: float = 0.01
    filler: str = "random"

    def generate(self, rng: np.random.Generator, n: int, train: bool):
        pairs, length, vocab = self.num_kv_pairs, self.seq_len, self.vocab_size
        half = vocab // 2
        keys = distinct_draws(rng, n, 1, half, pairs)
        values = distinct_draws(rng, n, half, vocab, pairs)
        if self.filler == "random":
            inputs = rng.integers(0, vocab, size=(n, length), dtype=np.int64)
        else:
            inputs = np.zeros((n, length), dtype=np.int64)
        targets = np.full((n, length), IGNORE, dtype=np.int64)
        inputs[:, 0 : 2 * pairs : 2] = keys
        inputs[:, 1 : 2 * pairs : 2] = values
        slots = power_law_slots(rng, n, (length - 2 * pairs) // 2, pairs, self.power_a)
        where = 2 * pairs + 2 * slots  # query i asks keys[:, i]
        np.put_along_axis(inputs, where, keys, axis=1)
        np.put_along_axis(targets, where, values, axis=1)
        return inputs, targets


FILLERS = ("random", "zero")


def mqar_task(seq_len: int, num_kv_pairs: int, vocab_size: int = 8192, power_a: float = 0.01,
              num_test: int = 1024, filler: str = "random") -> MQARTask:
    """MQAR at length ``seq_len`` with ``num_kv_pairs`` pairs over ``vocab_size`` tokens, the
    non-query positions holding ``filler`` (``"random"`` or ``"zero"``, see the module doc)."""
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")
    if num_kv_pairs < 1 or 4 * num_kv_pairs > seq_len:
        raise ValueError(f"num_kv_pairs must satisfy 1 <= 4 * num_kv_pairs <= seq_len, got {num_kv_pairs}")
    if vocab_size < 2 * num_kv_pairs + 2:
        raise ValueError(f"vocab_size {vocab_size} is too small for {num_kv_pairs} distinct pairs")
    return MQARTask(
        name="mqar", vocab_size=vocab_size, seq_len=seq_len, threshold=0.99, num_test=num_test,
        num_kv_pairs=num_kv_pairs, power_a=power_a, filler=filler,
    )
