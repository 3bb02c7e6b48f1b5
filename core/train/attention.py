"""Attention masks for tree-packed micro-batches: a dense one (CPU fallback) and a FlexAttention one.

In a tree row, token i may attend to token j iff j is i or one of its ancestors. Both masks here are
built from a micro-batch's ``predictor_index`` (each token's parent; -1 for roots and padding):

- ``dense_tree_mask``: [B, 1, T, T] bool, for the ``sdpa`` and ``eager`` attention of transformers.
  It costs T x T per row (a 25k-token episode is ~0.6 GB as bool, twice that once made additive).
- ``flex_tree_mask``: a FlexAttention ``BlockMask`` (torch >= 2.5), used on a CUDA device (the
X
  with ``attn_implementation="flex_attention"``. Tree samples come in depth-first preorder
  (``core.train.timelines``), so each token's descendants are the positions right after it, up to the end
  of its subtree: j may be seen from i iff j <= i <= subtree_end[j]. The mask function reads one
  [B, T] tensor, and the block mask keeps only which 128 x 128 tiles are empty, full or partial, so
  memory stays linear in T and empty tiles are skipped. Rows that are not in preorder (hand-built
  samples may order a tree any way that puts parents first) have no such ranges: there the dense
  mask is used instead, as an additive score mask, which transformers' flex path also accepts.

On the CPU the dense mask stays: torch 2.13 has no FlexAttention backward there (it raises), and
transformers compiles flex_attention with inductor first (minutes of C++ builds on a small runner).

This module builds masks and picks the attention; it does not score tokens (``core.train.packing``).
"""

from __future__ import annotations

import torch

try:  # torch >= 2.5; without it only the dense mask exists
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover - torch is pinned at 2.13
    BlockMask, create_block_mask = None, None

FLEX_ATTENTION = "flex_attention"
# Attention implementations of transformers 5.x that honour a custom additive 4D mask.
DENSE_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
TREE_ATTENTION_IMPLEMENTATIONS = (*DENSE_ATTENTION_IMPLEMENTATIONS, FLEX_ATTENTION)


Predictors = torch.Tensor | list[list[int]]  # [B, T] predictor index; the lists are a host copy


def _rows(predictor_index: Predictors) -> list[list[int]]:
    # A host copy (MicroBatch.host_predictors) is read as it is: no device-to-host sync.
    return predictor_index.tolist() if isinstance(predictor_index, torch.Tensor) else predictor_index


def _device(predictor_index: Predictors, device: torch.device | str | None) -> torch.device | str:
    if device is not None:
        return device
    return predictor_index.device if isinstance(predictor_index, torch.Tensor) else "cpu"


def dense_tree_mask(predictor_index: Predictors, device: torch.device | str | None = None) -> torch.Tensor:
    """[B, 1, T, T] bool: row i is True at i and its ancestors; padding rows see only themselves."""
    rows = _rows(predictor_index)
    b, width = len(rows), len(rows[0])
    mask = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)
    for row, predictors in enumerate(rows):
        # Parents precede children, so each row copies a finished row and adds itself.
        for i, p in enumerate(predictors):
            if p >= 0:
                mask[row, i] |= mask[row, p]
    return mask[:, None].to(_device(predictor_index, device))


def subtree_ends(predictor_index: Predictors, device: torch.device | str | None = None) -> torch.Tensor | None:
    """[B, T] long: the last position of each token's subtree, or None if a row is not in preorder."""
    ends = []
    for predictors in _rows(predictor_index):
        width = len(predictors)
        end, size = list(range(width)), [1] * width
        for i in range(width - 1, -1, -1):  # children after parents: one reverse sweep sums subtrees
            p = predictors[i]
            if p >= 0:
                end[p] = max(end[p], end[i])
                size[p] += size[i]
        if any(end[i] - i + 1 != size[i] for i in range(width)):
            return None  # some subtree is not one contiguous range
        ends.append(end)
    return torch.tensor(ends, dtype=torch.long, device=_device(predictor_index, device))


def flex_tree_mask(predictor_index: Predictors, device: torch.device | str | None = None) -> BlockMask | None:
    """The tree mask as a FlexAttention BlockMask, without a T x T tensor; None if not in preorder."""
    device = _device(predictor_index, device)
    ends = subtree_ends(predictor_index, device)
    if ends is None:
        return None
    b, width = ends.shape

    def may_attend(batch, head, q, kv):
        return (kv <= q) & (q <= ends[batch, kv])

    # Compiled on GPU: the eager builder evaluates the mask function over all T x T pairs at once.
    return create_block_mask(may_attend, b, None, width, width, device=device,
                             _compile=torch.device(device).type == "cuda")


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool "may attend" -> 0 where allowed, the dtype's minimum elsewhere (finite, so no NaN rows)."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, blocked)


def flex_by_default(device: torch.device) -> bool:
    """FlexAttention for tree batches on CUDA (where it has a backward) when torch has it."""
    return device.type == "cuda" and create_block_mask is not None


def tree_attention_mask(predictor_index: Predictors, implementation: str | None, dtype: torch.dtype,
                        flex: bool = False, device: torch.device | str | None = None,
                        ) -> tuple[torch.Tensor | BlockMask, str | None]:
    """(attention_mask, attention implementation) to run a tree micro-batch with.

    With `flex` (or a model loaded with flex_attention) and rows in preorder: a BlockMask, run by
    flex_attention. Otherwise the dense mask, additive in the model's dtype (eager Llama attention
    adds it to the scores), run by the model's own implementation.
    """
    if implementation is not None and implementation not in TREE_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"tree-packed micro-batches need attention implementation in {TREE_ATTENTION_IMPLEMENTATIONS}, "
            f"the model uses {implementation!r}; use merge mode 'linear' or load the model with one of those"
        )
    if flex or implementation == FLEX_ATTENTION:
        if create_block_mask is None:
            raise ValueError("FlexAttention needs torch >= 2.5")
        block_mask = flex_tree_mask(predictor_index, device)
        if block_mask is not None:
            return block_mask, FLEX_ATTENTION
    return additive(dense_tree_mask(predictor_index, device), dtype), implementation
