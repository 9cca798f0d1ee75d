"""The shapes a compiled drafter is given: a micro-batch's model inputs padded so that no dimension
the compiled graph guards on is ever 1.

torch.compile's dynamic shapes treat a size of 1 as a case of its own (a size-1 dimension
broadcasts), so the first micro-batch of one sample, or with so few anchors that its queries fit
one FlexAttention tile, compiles the whole drafter again: tens of seconds for the training graph,
forward and backward, in the middle of a run. A length bucket's last micro-batch is often that
small. Padding such a micro-batch to two rows and two query tiles costs a little compute on a rare
step instead of those compiles (a GPU's inductor may still guard on sizes of its own). The padded
rows and anchors are padding as the collate makes it (anchor -1, no label), and the drafter's
output is cut back to the real rows before the loss.

Sizes that happen to be equal in the first micro-batch (two rows and two query tiles, say) are
otherwise taken for one size ("duck sizing"), and the graph compiles again when they part:
distinct_sizes keeps them apart while the drafter is traced.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

__all__ = ["distinct_sizes", "min_anchors", "padded_model_inputs"]


def distinct_sizes(on: bool = True) -> contextlib.AbstractContextManager:
    """While open (and `on`), torch.compile traces every size as a symbol of its own, equal sizes
    included; torch's setting is restored on exit."""
    return fx_config.patch(use_duck_shape=False) if on else contextlib.nullcontext()


def min_anchors(block_size: int, tile: int) -> int:
    """The fewest anchors whose queries (anchors x block_size rows) span two `tile`-row tiles."""
    return tile // block_size + 1


def padded_model_inputs(taps: torch.Tensor, block_ids: torch.Tensor, block_pos: torch.Tensor,
                        anchors: torch.Tensor, *, block_size: int, tile: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """taps [b, T, K*H], block_ids and block_pos [b, N*bs], anchors [b, N] -> the same padded to at
    least 2 rows and min_anchors(block_size, tile) anchors: [b', T, K*H], [b', N'*bs] x 2, [b', N'].
    The added rows have zero taps and only padding anchors (-1); added anchors are -1 too, their
    block ids and positions 0. Unchanged (the same tensors) when already that large."""
    b, n = anchors.shape
    more_rows, more_anchors = max(0, 2 - b), max(0, min_anchors(block_size, tile) - n)
    if not more_rows and not more_anchors:
        return taps, block_ids, block_pos, anchors
    q = more_anchors * block_size
    # F.pad's widths run from the last dimension back: (last lo, hi, next lo, hi, ...)
    block_ids = F.pad(block_ids, (0, q, 0, more_rows))  # [b', N'*bs]
    block_pos = F.pad(block_pos, (0, q, 0, more_rows))  # [b', N'*bs]
    anchors = F.pad(anchors, (0, more_anchors, 0, more_rows), value=-1)  # [b', N']
    taps = F.pad(taps, (0, 0, 0, 0, 0, more_rows))  # [b', T, K*H]
    return taps, block_ids, block_pos, anchors
