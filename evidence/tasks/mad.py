"""The MAD synthetic suite (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures") at its baseline settings, written from the task definitions.

Baseline settings (``MAD_BASELINES``): vocabulary, length and training-set size per task; every
task trains on a fixed pool of ``num_train`` sequences and is scored on 1280 test sequences.
Recall tasks are multi-query: every value whose key occurred before is scored. As in MAD, the
recall tasks train on every next token and score only the recalled values; ``seq_len`` here is
the model's input length (MAD's length minus one for (noisy) in-context recall, whose reference
generator loses a token to the shift; fuzzy recall pads to keep it).

Where this differs from MAD's reference generator (documented in docs/results.md):
selective copying places the tokens to copy at uniformly random distinct positions (the
reference's insertion scheme always ends the prefix with a token to copy and draws them from an
unseeded generator); in fuzzy recall the probe pair always occurs in the context and a key keeps
one value throughout the sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .base import IGNORE, Task

NUM_TEST = 1280

MAD_BASELINES = {
    "in_context_recall": dict(vocab_size=16, seq_len=128, num_train=12800),
    "noisy_recall": dict(vocab_size=32, seq_len=128, num_train=12800, noise_vocab_size=16,
                         frac_noise=0.2),
    "fuzzy_recall": dict(vocab_size=16, seq_len=128, num_train=12800, k_motif_size=3,
                         v_motif_size=3),
    "selective_copying": dict(vocab_size=16, seq_len=256, num_train=12800, num_tokens_to_copy=16),
    "compression": dict(vocab_size=16, seq_len=32, num_train=12800),
    "memorization": dict(vocab_size=256, seq_len=32, num_train=256),
}


@dataclass(frozen=True)
class RecallTask(Task):
    """(Noisy) in-context recall over ``seq_len + 1`` generated tokens, shifted by one.

    Tokens ``[0, ns)`` with ``ns = vocab_size - noise_vocab_size`` hold keys ``[0, ns // 2)`` and
    values ``[ns // 2, ns)``; noise tokens are ``[ns, vocab_size)``. Each row has its own random
    key -> value map. The sequence is ``(seq_len + 1) // 2`` two-token slots; each slot but the
    last is a noise pair with probability ``frac_noise`` (never the one forced slot), else a pair
    ``k map[k]`` with a uniform key; the last slot repeats a key already shown.
    """

    noise_vocab_size: int = 0
    frac_noise: float = 0.0

    def generate(self, rng: np.random.Generator, n: int, train: bool):
        ns = self.vocab_size - self.noise_vocab_size
        n_keys = ns // 2
        slots = (self.seq_len + 1) // 2
        value_map = rng.integers(n_keys, ns, size=(n, n_keys))
        keys = rng.integers(0, n_keys, size=(n, slots))
        noise = rng.random((n, slots)) < self.frac_noise
        forced = rng.integers(0, slots - 1, size=n)
        noise[np.arange(n), forced] = False
        noise[:, -1] = False
        shown = np.zeros((n, n_keys), dtype=bool)
        repeat = np.zeros((n, slots), dtype=bool)
        rows = np.arange(n)
        for s in range(slots - 1):
            repeat[:, s] = shown[rows, keys[:, s]] & ~noise[:, s]
            shown[rows, keys[:, s]] |= ~noise[:, s]
        score = np.where(shown, rng.random((n, n_keys)), -1.0)
        keys[:, -1] = score.argmax(1)
        repeat[:, -1] = True
        values = np.take_along_axis(value_map, keys, axis=1)
        tokens = np.empty((n, 2 * slots), dtype=np.int64)
        tokens[:, 0::2], tokens[:, 1::2] = keys, values
        noise2 = np.repeat(noise, 2, axis=1)
        tokens[noise2] = rng.integers(ns, self.vocab_size, size=int(noise2.sum()))
        tokens = tokens[:, : self.seq_len + 1]
        if train:
            return tokens[:, :-1], tokens[:, 1:]
        labels = np.full_like(tokens, IGNORE)
        labels[:, 1::2] = np.where(repeat, values, IGNORE)[:, : labels[:, 1::2].shape[1]]
        return tokens[:, :-1], labels[:, 1:]


@dataclass(frozen=True)
class FuzzyRecallTask(Task):
    """Fuzzy in-context recall: keys and values are motifs of 1..k (1..v) distinct tokens.

    ``vocab_size - 1`` is the pad token; keys come from ``[0, (vocab_size - 1) // 2)``, values
    from the rest below the pad. Training keys have 1..k_motif_size tokens, test keys exactly
    ``k_motif_size``. A probe pair occurs in the context and is asked at the end; the row is
    left-padded to ``seq_len + 1`` tokens and shifted by one.
    """

    k_motif_size: int = 3
    v_motif_size: int = 3

    def _row(self, pyrng: random.Random, train: bool):
        kmax, vmax, total = self.k_motif_size, self.v_motif_size, self.seq_len + 1
        pad = self.vocab_size - 1
        key_vocab = range(0, pad // 2)
        value_vocab = range(pad // 2, pad)
        ksizes = range(1, kmax + 1) if train else (kmax,)

        def motif(vocab, size):
            return tuple(pyrng.sample(vocab, size))

        k_probe = motif(key_vocab, pyrng.choice(ksizes))
        v_probe = motif(value_vocab, pyrng.randint(1, vmax))
        budget = total - len(k_probe) - len(v_probe) - (kmax + vmax)
        probe_at = pyrng.randrange(max(budget - (kmax + vmax), 1))
        value_of = {k_probe: v_probe}
        shown: set = set()
        tokens: list = []
        labels: list = []
        while len(tokens) < budget:
            if k_probe not in shown and len(tokens) >= probe_at:
                k = k_probe
            else:
                k = motif(key_vocab, pyrng.choice(ksizes))
            if k not in value_of:
                value_of[k] = motif(value_vocab, pyrng.randint(1, vmax))
            v = value_of[k]
            tokens += k + v
            labels += [IGNORE] * len(k) + (list(v) if k in shown else [IGNORE] * len(v))
            shown.add(k)
        tokens += k_probe + v_probe
        labels += [IGNORE] * len(k_probe) + list(v_probe)
        fill = total - len(tokens)
        return [pad] * fill + tokens, [IGNORE] * fill + labels

    def generate(self, rng: np.random.Generator, n: int, train: bool):
        pyrng = random.Random(int(rng.integers(2**63)))
        rows = [self._row(pyrng, train) for _ in range(n)]
        tokens = np.array([r[0] for r in rows], dtype=np.int64)
        if train:
            return tokens[:, :-1], tokens[:, 1:]
        labels = np.array([r[1] for r in rows], dtype=np.int64)
        return tokens[:, :-1], labels[:, 1:]


@dataclass(frozen=True)
class SelectiveCopyingTask(Task):
    """Selective copying: ``num_tokens_to_copy`` tokens of ``[0, vocab_size - 2)`` scattered among
    blanks (``vocab_size - 2``), then the copy token (``vocab_size - 1``) and as many blanks, at
    which the scattered tokens are to be output in order."""

    num_tokens_to_copy: int = 16

    def __post_init__(self):
        if self.seq_len < 2 * self.num_tokens_to_copy + 1:
            raise ValueError(f"seq_len must be at least 2 num_tokens_to_copy + 1 = {2 * self.num_tokens_to_copy + 1} "
                             f"(the scattered tokens, the copy token and their copies), got {self.seq_len}")

    def generate(self, rng: np.random.Generator, n: int, train: bool):
        blank, copy, k = self.vocab_size - 2, self.vocab_size - 1, self.num_tokens_to_copy
        span = self.seq_len - k - 1
        to_copy = rng.integers(0, blank, size=(n, k))
        where = np.sort(np.argsort(rng.random((n, span)), axis=1)[:, :k], axis=1)
        inputs = np.full((n, self.seq_len), blank, dtype=np.int64)
        np.put_along_axis(inputs, where, to_copy, axis=1)
        inputs[:, span] = copy
        targets = np.full((n, self.seq_len), IGNORE, dtype=np.int64)
        targets[:, span + 1 :] = to_copy
        return inputs, targets


@dataclass(frozen=True)
class CompressionTask(Task):
    """Compression: ``seq_len - 1`` uniform tokens of ``[0, vocab_size - 1)`` and the compression
    token ``vocab_size - 1``; the whole input is reconstructed from the last position's vector
    (``head = "autoencoder"``)."""

    def generate(self, rng: np.random.Generator, n: int, train: bool):
        inputs = rng.integers(0, self.vocab_size - 1, size=(n, self.seq_len))
        inputs[:, -1] = self.vocab_size - 1
        return inputs, inputs.copy()


@dataclass(frozen=True)
class MemorizationTask(Task):
    """Memorization of a fixed key -> value map (the same for every run and split).

    Keys ``[0, (vocab_size - 1) // 2)`` each map to a distinct value of the upper half below the
    insert token ``vocab_size - 1``; the map is drawn once from ``kv_seed``. A row is
    ``seq_len // 2`` pairs ``key insert``; the value is scored at the insert token.
    """

    kv_seed: int = 12345

    def value_map(self) -> np.ndarray:
        """The fixed map as an array: ``value_map()[key]`` is key's value."""
        ns = self.vocab_size - 1
        return np.random.default_rng(self.kv_seed).permutation(np.arange(ns // 2, ns))[: ns // 2]

    def generate(self, rng: np.random.Generator, n: int, train: bool):
        values = self.value_map()
        keys = rng.integers(0, values.shape[0], size=(n, self.seq_len // 2))
        inputs = np.full((n, self.seq_len), self.vocab_size - 1, dtype=np.int64)
        inputs[:, 0::2] = keys
        targets = np.full((n, self.seq_len), IGNORE, dtype=np.int64)
        targets[:, 1::2] = values[keys]
        return inputs, targets


def sincos_positions(length: int, dim: int) -> torch.Tensor:
    """Fixed sinusoidal position codes ``(length, dim)``: sin and cos halves over geometric
    frequencies ``10000 ** (-i / (dim // 2))``."""
    half = dim // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = torch.arange(length, dtype=torch.float32)[:, None] * freq[None, :]
    codes = torch.cat([angle.sin(), angle.cos()], -1)
    return nn.functional.pad(codes, (0, dim - 2 * half))


class AutoencoderModel(nn.Module):
    """MAD's compression setting: encode with a sequence model, keep the last position's vector,
    decode every position from it with a non-expanding MLP.

    ``encoder`` is a :class:`kalmanscan.nn.SequenceModel`; its head is replaced by the identity so
    it returns the final-norm hidden states ``(B, L, D)``. Decoder per position ``i``:
    ``h + pos_i -> [RMSNorm, Linear(D, D), GELU] x 2 -> RMSNorm -> Linear(D, vocab)``.
    tokens (B, L) -> logits (B, L, vocab_size).
    """

    def __init__(self, encoder: nn.Module, seq_len: int, vocab_size: int):
        super().__init__()
        from kalmanscan.nn.common import RMSNorm

        dim = encoder.head.in_features
        encoder.head = nn.Identity()
        self.encoder = encoder
        self.register_buffer("positions", sincos_positions(seq_len, dim), persistent=False)
        self.decoder = nn.Sequential(
            RMSNorm(dim), nn.Linear(dim, dim), nn.GELU(),
            RMSNorm(dim), nn.Linear(dim, dim), nn.GELU(),
            RMSNorm(dim), nn.Linear(dim, vocab_size),
        )

    def forward(self, tokens):
        code = self.encoder(tokens)[:, -1]
        if tokens.shape[1] > self.positions.shape[0]:
            raise ValueError(f"tokens are longer ({tokens.shape[1]}) than seq_len {self.positions.shape[0]}")
        x = code[:, None, :] + self.positions[: tokens.shape[1]].to(code.dtype)
        return self.decoder(x)


_CLASSES = {
    "in_context_recall": RecallTask,
    "noisy_recall": RecallTask,
    "fuzzy_recall": FuzzyRecallTask,
    "selective_copying": SelectiveCopyingTask,
    "compression": CompressionTask,
    "memorization": MemorizationTask,
}


def mad_task(name: str, **overrides) -> Task:
    """The MAD task ``name`` at its baseline setting, with keyword ``overrides``."""
    if name not in MAD_BASELINES:
        raise ValueError(f"name must be one of {sorted(MAD_BASELINES)}, got {name!r}")
    cfg = {"threshold": 0.99, "num_test": NUM_TEST, **MAD_BASELINES[name], **overrides}
    if name in ("in_context_recall", "noisy_recall"):
        cfg["seq_len"] -= 1  # MAD's length counts the token lost to the shift
    head = "autoencoder" if name == "compression" else "lm"
    return _CLASSES[name](name=name, head=head, **cfg)
