"""What every task shares: the task contract, disjoint train/test splits, batches and metrics.

A task generates ``(inputs, targets)`` as int64 arrays of shape ``(n, L)``; ``targets`` holds
``IGNORE`` (-100) wherever no prediction is scored. Splits are made disjoint without storing
anything: every input row is hashed and its bucket (``hash % SPLIT_BUCKETS``) decides the split,
bucket 0 being ``"test"``. A row of the test stream therefore never occurs in the train stream,
whatever the seeds. Each split draws from its own generator, ``np.random.default_rng([seed,
split_index])``, so streams are reproducible by seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100
SPLITS = ("train", "test")
SPLIT_BUCKETS = 4

_FNV_PRIME = np.uint64(0x100000001B3)
_OFFSET = np.uint64(0xCBF29CE484222325)


@dataclass(frozen=True)
class Task:
    """A sequence task: ``inputs (n, seq_len)`` tokens in ``[0, vocab_size)``, scored ``targets``.

    Subclasses define ``generate(rng, n, train) -> (inputs, targets)``. ``train=False`` gives the evaluation
    targets; a task whose training loss differs from its score (the MAD recall tasks train on
    every next token) returns the training targets when ``train=True``.

    Attributes: ``threshold`` is the validation token accuracy that counts as solved (training
    stops early there); ``num_train`` is the size of a fixed training pool (``None``: a fresh
    batch every step); ``num_test`` the validation set size; ``head`` is ``"lm"`` (logits at
    every position) or ``"autoencoder"`` (one vector at the last position, decoded to the whole
    sequence).
    """

    name: str
    vocab_size: int
    seq_len: int
    threshold: float = 0.99
    num_train: int | None = None
    num_test: int = 1024
    head: str = "lm"


def row_hash(rows: np.ndarray) -> np.ndarray:
    """FNV-1a over the tokens of each row, then a splitmix64 finaliser: ``(n, L) -> (n,)`` uint64.

    Overflow wraps modulo 2**64 by design; the result depends only on the row's content.
    """
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError(f"rows must have shape (n, L), got {rows.shape}")
    h = np.full(rows.shape[0], _OFFSET, dtype=np.uint64)
    cols = rows.astype(np.uint64)
    with np.errstate(over="ignore"):
        for j in range(cols.shape[1]):
            h = (h ^ cols[:, j]) * _FNV_PRIME
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return h


def split_of(inputs: np.ndarray) -> np.ndarray:
    """The split index of every row of ``inputs (n, L)``: 1 (test) for hash bucket 0, else 0."""
    return (row_hash(inputs) % np.uint64(SPLIT_BUCKETS) == 0).astype(np.int64)


def split_rng(seed: int, split: str) -> np.random.Generator:
    """The generator of one split's stream, independent of the other split's."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return np.random.default_rng([int(seed), SPLITS.index(split)])


def draw(task: Task, rng: np.random.Generator, n: int, split: str, train: bool | None = None):
    """``n`` examples of ``task`` whose inputs lie in ``split``'s hash buckets.

    Generates candidates in rounds and keeps the rows of the requested split. ``train`` picks the
    targets (default: training targets for ``"train"``, evaluation targets for ``"test"``).
    Returns ``(inputs, targets)``, int64 arrays of shape ``(n, L)``.
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    want = SPLITS.index(split)
    train = split == "train" if train is None else train
    share = 1.0 / SPLIT_BUCKETS if want == 1 else 1.0 - 1.0 / SPLIT_BUCKETS
    kept_x, kept_y, have = [], [], 0
    for _ in range(64):
        m = int((n - have) / share * 1.25) + 8
        x, y = task.generate(rng, m, train)
        keep = split_of(x) == want
        kept_x.append(x[keep])
        kept_y.append(y[keep])
        have += int(keep.sum())
        if have >= n:
            return np.concatenate(kept_x)[:n], np.concatenate(kept_y)[:n]
    raise ValueError(f"task {task.name!r} has too few distinct sequences to fill the {split} split")


def validation_set(task: Task, seed: int, n: int | None = None):
    """The validation set: ``n`` (default ``task.num_test``) rows of the test split, by seed."""
    return draw(task, split_rng(seed, "test"), n or task.num_test, "test", train=False)


class TrainBatches:
    """Endless training batches ``(inputs, targets)`` of ``batch_size`` rows, by seed.

    With ``task.num_train`` set, a fixed pool of that many train-split rows is drawn once and
    served in shuffled epochs (the MAD protocol; a batch larger than the pool is drawn with
    replacement, one per epoch); otherwise every batch is fresh. ``state_dict()`` is the stream's
    position (the generator's state and the current epoch's order); ``load_state_dict`` on a
    stream of the same task, seed and batch size continues exactly where that one was.
    """

    def __init__(self, task: Task, seed: int, batch_size: int):
        self.task, self.batch_size = task, batch_size
        self.rng = split_rng(seed, "train")
        self.pool = None if task.num_train is None else draw(task, self.rng, task.num_train, "train")
        self.order, self.start = None, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pool is None:
            return draw(self.task, self.rng, self.batch_size, "train")
        n, b = self.task.num_train, self.batch_size
        if b > n:
            self.rng.permutation(n)                 # the epoch's order, unused: keeps the stream
            idx = self.rng.choice(n, b)
        else:
            if self.order is None or self.start + b > n:
                self.order, self.start = self.rng.permutation(n), 0
            idx = self.order[self.start : self.start + b]
            self.start += b
        return self.pool[0][idx], self.pool[1][idx]

    def state_dict(self) -> dict:
        order = None if self.order is None else torch.from_numpy(self.order)
        return {"rng": self.rng.bit_generator.state, "order": order, "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = None if state["order"] is None else state["order"].numpy()
        self.start = state["start"]


def train_batches(task: Task, seed: int, batch_size: int) -> TrainBatches:
    """The training stream of ``task`` by seed (see :class:`TrainBatches`)."""
    return TrainBatches(task, seed, batch_size)


class Scores:
    """Accumulates accuracies over evaluation batches.

    ``update(pred, targets)`` takes ``pred, targets (B, L)`` (targets with ``IGNORE``);
    ``result()`` returns
      ``token_acc``     correct scored tokens / scored tokens (plain accuracy);
      ``seq_acc``       share of sequences with every scored token correct;
      ``mean_seq_acc``  per-sequence token accuracy averaged over sequences (MQAR's measure);
      ``macro_acc``     per-class recall averaged over the target classes that occur.
    Sequences with no scored token are left out of the sequence measures.
    """

    def __init__(self, num_classes: int):
        self.num_classes = int(num_classes)
        self.correct = 0
        self.scored = 0
        self.seq_all = 0
        self.seq_mean = 0.0
        self.seqs = 0
        self.class_correct = torch.zeros(self.num_classes, dtype=torch.float64)
        self.class_total = torch.zeros(self.num_classes, dtype=torch.float64)

    def update(self, pred: torch.Tensor, targets: torch.Tensor) -> None:
        if pred.shape != targets.shape:
            raise ValueError(f"pred {tuple(pred.shape)} and targets {tuple(targets.shape)} differ")
        mask = targets != IGNORE
        hit = (pred == targets) & mask
        per_seq = mask.sum(-1)
        has = per_seq > 0
        self.correct += int(hit.sum())
        self.scored += int(mask.sum())
        self.seq_all += int(((hit.sum(-1) == per_seq) & has).sum())
        self.seq_mean += float((hit.sum(-1)[has].double() / per_seq[has].double()).sum())
        self.seqs += int(has.sum())
        cls = targets[mask].long().cpu()
        self.class_total += torch.bincount(cls, minlength=self.num_classes).double()
        self.class_correct += torch.bincount(
            cls, weights=hit[mask].double().cpu(), minlength=self.num_classes
        )

    def result(self) -> dict:
        present = self.class_total > 0
        macro = (self.class_correct[present] / self.class_total[present]).mean()
        return {
            "token_acc": self.correct / max(self.scored, 1),
            "seq_acc": self.seq_all / max(self.seqs, 1),
            "mean_seq_acc": self.seq_mean / max(self.seqs, 1),
            "macro_acc": float(macro) if bool(present.any()) else 0.0,
        }
