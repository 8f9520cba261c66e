"""Packed documents in the layers: what the KLA block needs beyond the scan's ``cu_seqlens``.

A batch of ``N`` documents laid end to end in one row ``(1, total, D)`` with int32 offsets
``cu_seqlens`` ``(N + 1,)`` (:mod:`kalmanscan.ops.kla.documents`) must give each document the
output it would get alone: the scan restarts its filters at each document's first token, and the
causal depthwise conv (:func:`document_conv`) reads no token of an earlier document.
"""

from __future__ import annotations

import torch
from torch import nn

from kalmanscan.ops.kla.documents import token_documents

__all__ = ["document_conv"]


def document_conv(z: torch.Tensor, conv: nn.Conv1d, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The causal depthwise conv of ``z`` ``(1, total, M)`` within each document: ``out[t] = bias +
    sum_j weight[:, j] z[t - (K - 1 - j)]``, the taps before the document's first token read as 0
    (as :func:`kalmanscan.nn.common.causal_conv` from a zero window reads a sequence's start).
    Device operations only (no synchronisation); the output is before its activation."""
    L, K = z.shape[1], conv.kernel_size[0]
    doc, _ = token_documents(cu_seqlens, L)
    position = torch.arange(L, device=z.device) - cu_seqlens[doc]      # within its document
    padded = torch.nn.functional.pad(z, (0, 0, K - 1, 0))
    weight = conv.weight[:, 0].to(z.dtype)                              # (M, K)

    def tap(j):  # z[t - (K - 1 - j)], 0 before the document's start
        return torch.where((position >= K - 1 - j).view(1, L, 1), padded[:, j:j + L], 0.0) * weight[:, j]

    out = conv.bias.to(z.dtype) + tap(0)
    for j in range(1, K):  # the order of causal_conv's sum
        out = out + tap(j)
    return out
