"""Packed documents in the layers: what the KLA block needs beyond the scan's ``cu_seqlens``.

A batch of ``N`` documents laid end to end in one row ``(1, total, D)`` with int32 offsets
``cu_seqlens`` ``(N + 1,)`` (:mod:`kalmanscan.ops.kla.documents`) must give each document the
output it would get alone: the scan restarts its filters at each document's first token, and the
causal depthwise conv (:func:`document_conv`) reads no token of an earlier document. A document
may continue its own pre-conv window (one row of a ``(N, K - 1, M)`` window per document, as a
sequence continues its window in :func:`kalmanscan.nn.common.causal_conv`), and
:func:`document_windows` gives each document's window after its last token.
"""

from __future__ import annotations

import torch
from torch import nn

from kalmanscan.ops.kla.documents import token_documents

__all__ = ["document_conv", "document_windows"]


def document_conv(z: torch.Tensor, conv: nn.Conv1d, cu_seqlens: torch.Tensor,
                  window: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise conv of ``z`` ``(1, total, M)`` within each document: ``out[t] = bias +
    sum_j weight[:, j] padded_d[p + j]``, ``p`` the token's place in its document ``d`` and
    ``padded_d = [window[d]; z_d]`` (as :func:`kalmanscan.nn.common.causal_conv` reads one
    sequence continuing its window). ``window`` ``(N, K - 1, M)``: each document's pre-conv window;
    ``None``: zeros (the taps before a document's first token read 0). Device operations only (no
    synchronisation); the output is before its activation."""
    L, K = z.shape[1], conv.kernel_size[0]
    doc, _ = token_documents(cu_seqlens, L)
    position = torch.arange(L, device=z.device) - cu_seqlens[doc]                # within its document
    padded = torch.nn.functional.pad(z, (0, 0, K - 1, 0))
    weight = conv.weight[:, 0].to(z.dtype)                                       # (M, K)
    rows = None if window is None or K == 1 else window.to(z.dtype)

    def tap(j):  # padded_d[p + j]: z[t - (K - 1 - j)] within the document, else the window's row p + j
        before = 0.0 if rows is None else rows[doc, (position + j).clamp(max=K - 2)][None]
        return torch.where((position >= K - 1 - j).view(1, L, 1), padded[:, j:j + L], before) * weight[:, j]

    out = conv.bias.to(z.dtype) + tap(0)
    for j in range(1, K):  # the order of causal_conv's sum
        out = out + tap(j)
    return out


def document_windows(z: torch.Tensor, cu_seqlens: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Each document's pre-conv window after its last token, ``(N, K - 1, M)``: the last ``K - 1``
    rows of ``padded_d = [window[d]; z_d]`` (``z`` ``(1, total, M)``, ``window`` ``(N, K - 1, M)``
    the windows the documents started from; an empty document keeps its own). In ``window``'s
    dtype; device operations only."""
    N, width = window.shape[0], window.shape[1]
    ends = cu_seqlens[1:].long().view(N, 1)
    lengths = ends - cu_seqlens[:-1].long().view(N, 1)
    i = torch.arange(width, device=z.device).view(1, width)
    from_z = (lengths + i >= width).unsqueeze(-1)                                  # row i of the new window
    at = (ends - width + i).clamp(0, max(z.shape[1] - 1, 0))
    kept = window.gather(1, (lengths + i).clamp(max=width - 1).unsqueeze(-1).expand(-1, -1, window.shape[2]))
    if z.shape[1] == 0:
        return kept
    return torch.where(from_z, z[0, at].to(window.dtype), kept)
