"""Group word problems: i.i.d. group elements in, the running product out at every position.

Groups (element 0 is always the identity):
    ``a5``     the alternating group on 5 points (order 60, simple non-abelian: NC1-complete
               word problem, the state-tracking case)
    ``s5``     the symmetric group on 5 points (order 120)
    ``a4xz5``  A4 x Z5 (order 60, solvable non-abelian: a control of the same order as A5)
    ``z60``    the cyclic group of order 60 (abelian: the control every mixer should solve)

Permutations compose as maps, ``(a * b)(i) = a[b[i]]``; the target at position t is the running
product ``g_1 * g_2 * ... * g_t`` (so ``P_t = P_{t-1} * g_t``). ``table[a, b]`` is the index of
``a * b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations

import numpy as np

from .base import Task

GROUPS = ("a5", "s5", "a4xz5", "z60")


def _parity(perm) -> int:
    """0 for an even permutation, 1 for odd (by counting inversions)."""
    n = len(perm)
    return sum(perm[i] > perm[j] for i in range(n) for j in range(i + 1, n)) % 2


def permutation_elements(n: int, even_only: bool) -> np.ndarray:
    """All (even) permutations of ``range(n)`` as rows ``(G, n)``, identity first."""
    perms = [p for p in permutations(range(n)) if not (even_only and _parity(p))]
    return np.array(perms, dtype=np.int64)


def permutation_table(elements: np.ndarray) -> np.ndarray:
    """Multiplication table ``(G, G)`` of the permutations ``elements (G, n)``: a * b = a[b]."""
    g, n = elements.shape
    composed = elements[np.arange(g)[:, None, None], elements[None, :, :]]  # (G, G, n)
    codes = (elements * n ** np.arange(n)).sum(-1)
    index = {int(c): i for i, c in enumerate(codes)}
    flat = (composed * n ** np.arange(n)).sum(-1)
    try:
        return np.vectorize(index.__getitem__)(flat).astype(np.int64)
    except KeyError as err:
        raise ValueError("elements are not closed under composition") from err


def cyclic_table(order: int) -> np.ndarray:
    """Multiplication table of Z_order: ``(a + b) mod order``."""
    a = np.arange(order)
    return (a[:, None] + a[None, :]) % order


def direct_product_table(t1: np.ndarray, t2: np.ndarray) -> np.ndarray:
    """Table of G1 x G2, element ``(x, y)`` at index ``x * |G2| + y``, componentwise product."""
    g2 = t2.shape[0]
    x = np.arange(t1.shape[0] * g2)
    prod1 = t1[(x // g2)[:, None], (x // g2)[None, :]]
    prod2 = t2[(x % g2)[:, None], (x % g2)[None, :]]
    return prod1 * g2 + prod2


@lru_cache(maxsize=None)
def group_table(name: str) -> np.ndarray:
    """The multiplication table ``(G, G)`` int64 of the group ``name`` (one of ``GROUPS``)."""
    if name == "a5":
        table = permutation_table(permutation_elements(5, even_only=True))
    elif name == "s5":
        table = permutation_table(permutation_elements(5, even_only=False))
    elif name == "a4xz5":
        table = direct_product_table(
            permutation_table(permutation_elements(4, even_only=True)), cyclic_table(5)
        )
    elif name == "z60":
        table = cyclic_table(60)
    else:
        raise ValueError(f"group must be one of {GROUPS}, got {name!r}")
    table.setflags(write=False)
    return table


def running_product(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Prefix products of ``tokens (n, L)`` under ``table``: out[:, t] = tokens[:, 0] * ... * tokens[:, t]."""
    out = np.empty_like(tokens)
    acc = tokens[:, 0]
    out[:, 0] = acc
    for t in range(1, tokens.shape[1]):
        acc = table[acc, tokens[:, t]]
        out[:, t] = acc
    return out


@dataclass(frozen=True)
class GroupWordTask(Task):
    """Word problem of ``group``: tokens are i.i.d. uniform elements, every position is scored.

    ``vocab_size`` is the group order (inputs and outputs share it); solved means validation
    token accuracy above ``threshold`` (0.9, the A5 protocol's criterion).
    """

    group: str = "a5"

    def generate(self, rng: np.random.Generator, n: int, train: bool):
        table = group_table(self.group)
        tokens = rng.integers(0, table.shape[0], size=(n, self.seq_len), dtype=np.int64)
        return tokens, running_product(table, tokens)


def group_task(group: str, seq_len: int, num_test: int = 1024) -> GroupWordTask:
    """The word problem of ``group`` at length ``seq_len`` (fresh training batches every step)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    order = group_table(group).shape[0]
    return GroupWordTask(
        name=group, vocab_size=order, seq_len=seq_len, threshold=0.9, num_test=num_test,
        group=group,
    )
