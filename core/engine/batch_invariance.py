"""Batch-invariant decoding for the hf engine's repeatable sampling: a row's logits come out the same bits
whichever rows share its decode step.

Two things in a continuously batched decode step change a row's last bits with its company (measured on
this project's CPUs: docs/benchmarks.md, "Repeatable sampling to the last bit"):
- **the keys' left padding**: every row's keys are padded to the batch's widest row. Masked columns weigh
  exactly zero, but SDPA's kernels reduce over the key axis in vector lanes, so where a row's live columns
  start changes the order of its sums. `row_attention` runs the rows that attend to the same number of
  columns as one unpadded SDPA call on just those columns (a GRPO group's rows share one call);
- **the matrices' height**: BLAS picks its GEMM kernel by the number of rows M, and a row of
  [M, K] @ [K, N] is the same bits for every M from some height on (here 4; a matrix-vector product,
  M = 1, and M = 2-3 sum in other orders). `invariant_rows` measures that height for a model's linear
  layers on the machine it runs on; the engine pads a decode step with fewer rows to it.

`row_attention` is registered with transformers under `ROW_ATTENTION` (the sdpa mask builder makes its
masks); the engine decodes through `core.models.attention_view(model, ROW_ATTENTION)`, so the model's
own config, and the trainer, keep theirs. A forward of more than one query token (a prefill) or without
a mask is SDPA as transformers runs it. Deliberately not here: the padding rows, and prefilling prompts
only beside prompts of their own length (`core.engine.hf`); any GPU kernel's invariance (cuBLAS may
split a reduction by shape: `invariant_rows` then finds no height below the batch's, and the engine
decodes every step that tall). It costs an SDPA call per distinct row length and layer, and on a GPU a
device read of the mask per layer: it is for repeatable runs, not for throughput (docs/benchmarks.md
has the price).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROW_ATTENTION = "swarmrl_rows"


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query` [B, heads, q, D], `key`/`value` [B, kv heads, L, D],
    `attention_mask` [B, 1, q, L] (bool: may attend, or additive). Returns ([B, q, heads, D], None)."""
    if query.shape[2] != 1 or attention_mask is None or attention_mask.dim() != 4:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    allowed = attention_mask[:, 0, -1, :]
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    # A row of the engine's batch cache is left-padded: it attends to its last `length` columns.
    lengths = allowed.sum(-1).tolist()
    out = None
    for length in sorted(set(lengths)):
        rows = [i for i, n in enumerate(lengths) if n == length]
        # Rows admitted together sit next to each other: a slice is a view, an index a copy of their keys.
        index = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else \
            torch.tensor(rows, device=query.device)
        part, _ = sdpa_attention_forward(module, query[index], key[index, :, -length:], value[index, :, -length:],
                                         None, **kwargs)
        if out is None:
            out = part.new_empty((query.shape[0], *part.shape[1:]))
        out[index] = part
    return out, None


AttentionInterface.register(ROW_ATTENTION, row_attention)
AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)


@torch.inference_mode()
def invariant_rows(model: torch.nn.Module, max_rows: int) -> int:
    """The fewest rows from which every linear layer of `model` gives a row the same bits at any height
    up to `max_rows` (`max_rows` itself when no lower height does): random rows through each distinct
    weight shape, at every height from `max_rows` down until a row's output changes."""
    layers = {tuple(m.weight.shape): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lowest = 1
    for layer in layers.values():
        rows = torch.randn(max_rows, layer.in_features, generator=torch.Generator().manual_seed(0))
        rows = rows.to(device=layer.weight.device, dtype=layer.weight.dtype)
        first = layer(rows)[:1]
        height = max_rows
        while height > lowest and torch.equal(layer(rows[: height - 1])[:1], first):
            height -= 1
        lowest = height
    return lowest
