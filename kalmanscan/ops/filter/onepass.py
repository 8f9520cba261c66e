"""The triton backend's single-pass forward for many series (:mod:`kalmanscan.kernels.filter.onepass`):
each stretch of ``config.onepass`` steps read once into registers, its map composed, the state
entering it found by a decoupled look-back over the earlier stretches, and its outputs written from
the same registers.

:func:`kalmanscan.ops.filter.triton.filter_forward` hands a problem here when
``FilterConfig.onepass`` is set, the problem runs on the walks (not the tiles) and it is longer
than one stretch; it writes the same fields with the same conventions as the three-kernel walks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kalmanscan.kernels.filter.onepass import filter_onepass_kernel

from ..launch import cdiv, next_power_of_2
from .config import DEFAULT_CONFIG, FilterConfig

__all__ = ["applies", "forward"]


def applies(T: int, config: FilterConfig = DEFAULT_CONFIG) -> bool:
    """Whether the single-pass forward serves a problem of ``T`` steps that runs on the walks."""
    return config.onepass > 0 and T > config.onepass


def forward(args: Sequence, init: torch.Tensor, pointers: Sequence[torch.Tensor], shape: tuple[int, int, int],
            options: dict, config: FilterConfig = DEFAULT_CONFIG, loglik_sum: bool = False) -> torch.Tensor | None:
    """Launch the single-pass forward on the walks' kernel arguments ``args`` (inputs and strides
    in kernel order), ``init`` ``(B, 2, C)`` and the ten output ``pointers``; ``options`` holds the
    step flags, the ``WRITE_*`` flags and ``POSTERIOR``. With ``loglik_sum`` returns each
    stretch's log-likelihood sum, ``(B, NS, C)`` float64, else ``None``."""
    B, T, C = shape
    y = args[0]
    R = config.onepass
    ns = cdiv(T, R)
    block = min(config.onepass_block, next_power_of_2(C))
    ncb = cdiv(C, block)
    start = torch.empty(B, 2, ns + 1, C, dtype=y.dtype, device=y.device)
    start[:, :, 0, :] = init
    agg = torch.empty(B, 7, ns, C, dtype=y.dtype, device=y.device)
    flag = torch.zeros(1 + B * ns * ncb, dtype=torch.int32, device=y.device)
    partial = torch.empty(B, ns, C, dtype=torch.float64, device=y.device) if loglik_sum else None
    filter_onepass_kernel[(ns * B * ncb,)](
        *args, agg, start, flag, *pointers, B, T, C, ns, ncb, **options,
        BLOCK=block, WIDE=4 * B * T * C >= config.wide_from, R=R, W=config.onepass_lookback,
        PUBLISH=config.onepass_publish,
        num_warps=max(1, min(config.onepass_warps, block // 32)),
        loglik_sum_ptr=partial, SUM_LOGLIK=partial is not None)
    return partial
