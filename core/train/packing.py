"""Sequence packing: training samples -> padded micro-batches, and their per-token logprobs.

``pack`` groups samples into micro-batches whose padded size (rows x longest row) stays within a
token budget, first-fit-decreasing, and builds the tensors one forward pass needs. ``token_logprobs``
runs a Hugging Face causal LM over a micro-batch and returns each token's logprob under the model
and the entropy of the distribution that predicted it.

Linear samples use a plain 2D padding mask, so attention kernels keep their fast causal path.
A micro-batch holding any tree sample (``Sample.parents`` set) is scored with a tree mask instead:
token i sees token j iff j is i or one of its ancestors. The mask is built at scoring time from
``predictor_index`` by ``core.train.attention``: a FlexAttention block mask (linear memory in T) for
a model loaded with ``flex_attention``, else a dense additive T x T mask (``sdpa``, ``eager``). In a
tree the token predicting token i is its parent, not i - 1, so logprobs are read from the parent's
logits.

Each token is scored at the temperature its behaviour logprob was recorded at (``Sample.temperatures``):
log softmax(logits / T_t) at its predictor, so the PPO ratio compares the same distribution the
engine sampled from. Several children of one tree node may carry different temperatures, so the
scaling is per scored token, not per predicting position.

This module does not compute losses or advantages, and does not decide which samples to train.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from core.engine.sampling import nucleus as nucleus_of
from core.models import attention_view
from core.train.timelines import Sample
from core.train.attention import TREE_ATTENTION_IMPLEMENTATIONS, flex_by_default, tree_attention_mask

__all__ = ["TREE_ATTENTION_IMPLEMENTATIONS", "MicroBatch", "pack", "token_logprobs"]

# Filler id for padded positions; any valid id works because padding is masked out of attention and loss.
PAD_ID = 0


@dataclass
class MicroBatch:
    """Padded tensors for one forward pass; B rows, T = longest row."""

    input_ids: torch.Tensor  # [B, T] long, PAD_ID on padding
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    old_logprobs: torch.Tensor  # [B, T] float32 behaviour logprobs, 0 off the mask
    advantages: torch.Tensor  # [B, T] float32, each token's advantage (its episode's)
    weights: torch.Tensor  # [B, T] float32, each token's loss weight
    temperatures: torch.Tensor  # [B, T] float32, the temperature each token is scored at; 1 on padding
    top_ps: torch.Tensor  # [B, T] float32, the nucleus each token was sampled within; 1 on padding
    position_ids: torch.Tensor  # [B, T] long: index for linear rows, depth for tree rows
    predictor_index: torch.Tensor  # [B, T] long: position whose logits predict each token; -1 if none
    attention_mask: torch.Tensor  # [B, T] long padding mask (trees: see `is_tree`)
    rows: list[int]  # index of each row's sample in the list given to `pack`
    lengths: list[int]  # real (unpadded) tokens of each row
    # True when a row is a tree: scoring then builds the tree mask from predictor_index
    # (core.train.attention), not from the padding mask; no T x T tensor is kept here.
    is_tree: bool = False
    # Host copies of what scoring branches on, so it never reads them back from the device:
    # predictor_index as lists (for the tree mask) and whether any token was sampled with top_p < 1.
    host_predictors: list[list[int]] | None = None
    nucleus: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            loss_mask=self.loss_mask.to(device),
            old_logprobs=self.old_logprobs.to(device),
            advantages=self.advantages.to(device),
            weights=self.weights.to(device),
            temperatures=self.temperatures.to(device),
            top_ps=self.top_ps.to(device),
            position_ids=self.position_ids.to(device),
            predictor_index=self.predictor_index.to(device),
            attention_mask=self.attention_mask.to(device),
            rows=self.rows,
            lengths=self.lengths,
            is_tree=self.is_tree,
            host_predictors=self.host_predictors,
            nucleus=self.nucleus,
        )


def _check(samples: Sequence[Sample], token_budget: int) -> None:
    if token_budget < 1:
        raise ValueError(f"token_budget must be at least 1, got {token_budget}")
    for i, s in enumerate(samples):
        if not s.input_ids:
            raise ValueError(f"sample {i} (episode {s.episode_id!r}) is empty")
        if min(s.input_ids) < 0:
            raise ValueError(f"sample {i} (episode {s.episode_id!r}) has a negative token id")
        if s.parents is not None:
            bad = [j for j, p in enumerate(s.parents) if not -1 <= p < j]
            if bad:
                # Depth-first order puts every parent before its children; anything else is not a tree.
                raise ValueError(
                    f"sample {i} (episode {s.episode_id!r}): parents must precede their children, "
                    f"violated at positions {bad[:5]}"
                )


def _first_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group indices so each group's rows x longest row <= budget; an oversized item stands alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        for group in groups:
            # Sorted decreasing, so a group's first item is its longest and sets its padded width.
            if (len(group) + 1) * lengths[group[0]] <= token_budget:
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


def _collate(samples: Sequence[Sample], rows: list[int]) -> MicroBatch:
    batch = [samples[r] for r in rows]
    width = max(len(s.input_ids) for s in batch)
    b = len(batch)
    input_ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    old_logprobs = torch.zeros((b, width), dtype=torch.float32)
    advantages = torch.zeros((b, width), dtype=torch.float32)
    weights = torch.zeros((b, width), dtype=torch.float32)
    temperatures = torch.ones((b, width), dtype=torch.float32)
    top_ps = torch.ones((b, width), dtype=torch.float32)
    position_ids = torch.zeros((b, width), dtype=torch.long)
    predictor_index = torch.full((b, width), -1, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    for row, s in enumerate(batch):
        n = len(s.input_ids)
        input_ids[row, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        loss_mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        old_logprobs[row, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        advantages[row, :n] = torch.tensor(s.token_advantages(), dtype=torch.float32)
        weights[row, :n] = torch.tensor(s.token_weights(), dtype=torch.float32)
        if s.temperatures is not None:
            temperatures[row, :n] = torch.tensor(s.temperatures, dtype=torch.float32)
        if s.top_ps is not None:
            top_ps[row, :n] = torch.tensor(s.top_ps, dtype=torch.float32)
        position_ids[row, :n] = torch.tensor(s.position_ids, dtype=torch.long)
        predictor_index[row, :n] = torch.tensor(s.predictors(), dtype=torch.long)
        attention[row, :n] = 1
    return MicroBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        advantages=advantages,
        weights=weights,
        temperatures=temperatures,
        top_ps=top_ps,
        position_ids=position_ids,
        predictor_index=predictor_index,
        attention_mask=attention,
        rows=rows,
        lengths=[len(s.input_ids) for s in batch],
        is_tree=any(s.parents is not None for s in batch),
        host_predictors=[s.predictors() + [-1] * (width - len(s.input_ids)) for s in batch],
        nucleus=any(s.top_ps is not None and min(s.top_ps, default=1.0) < 1.0 for s in batch),
    )


def pack(samples: Sequence[Sample], token_budget: int) -> list[MicroBatch]:
    """Pack samples into micro-batches of at most `token_budget` padded tokens each.

    A sample longer than the budget forms its own micro-batch. Every sample lands in exactly one
    micro-batch; `MicroBatch.rows` maps rows back to `samples`.
    """
    _check(samples, token_budget)
    groups = _first_fit_decreasing([len(s.input_ids) for s in samples], token_budget)
    return [_collate(samples, group) for group in groups]


def micro_batch_count(samples: Sequence[Sample], token_budget: int) -> int:
    """How many micro-batches `pack` makes of `samples`, without building them."""
    return len(_first_fit_decreasing([len(s.input_ids) for s in samples], token_budget)) if samples else 0


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _attention_implementation(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, flex: bool | None = None, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprob [B, T] (with grad) and predictive entropy [B, T] (detached, for telemetry).

    Token t is scored by the logits at its predictor (t - 1 in a line, its parent in a tree), divided
    by its temperature. Only `positions` ([B, T] bool; default every token with a predictor) are
    scored; the rest, and tokens without a predictor (roots, padding), get 0 in both. The trainer
    passes the loss mask. The micro-batch is moved to the model's device. `flex`: score tree batches
    with FlexAttention; None picks it on CUDA.

    Memory: the decoder's hidden states are projected to the vocabulary only at the scored
    positions, `LOGIT_CHUNK` rows at a time, each chunk recomputed in the backward pass instead of
    kept, so no [B, T, V] tensor exists (at 4k tokens x 152k vocabulary a full fp32 one is 2.5 GB,
    and the softmax for entropy another). This needs a causal LM whose logits are its output
    embedding applied to the decoder's last hidden state (Llama, Qwen2, Mistral, SmolLM2: no logit
    soft-capping or scaling), which `_decoder_and_head` checks.
    """
    device = next(model.parameters()).device
    mb = mb.to(device)
    implementation = _attention_implementation(model)
    if mb.is_tree:
        flex = flex_by_default(device) if flex is None else flex
        predictors = mb.host_predictors if mb.host_predictors is not None else mb.predictor_index
        attention_mask, implementation = tree_attention_mask(
            predictors, implementation, _model_dtype(model), flex, device=device
        )
    else:
        attention_mask = mb.attention_mask
    decoder, head = _decoder_and_head(attention_view(model, implementation))
    hidden = decoder(
        input_ids=mb.input_ids,
        attention_mask=attention_mask,
        position_ids=mb.position_ids,
        use_cache=False,
    ).last_hidden_state  # [B, T, H]
    scored = mb.predictor_index >= 0
    if positions is not None:
        scored = scored & positions.to(device)
    rows, cols = scored.nonzero(as_tuple=True)
    states = hidden[rows, mb.predictor_index[rows, cols]]  # [N, H]: each scored token's predicting state
    tokens, temperatures, top_ps = mb.input_ids[rows, cols], mb.temperatures[rows, cols], mb.top_ps[rows, cols]
    pieces = [checkpoint(_score_chunk, head, states[k : k + LOGIT_CHUNK], tokens[k : k + LOGIT_CHUNK],
                         temperatures[k : k + LOGIT_CHUNK], top_ps[k : k + LOGIT_CHUNK], mb.nucleus,
                         use_reentrant=False)
              for k in range(0, len(tokens), LOGIT_CHUNK)]
    logprobs = torch.zeros(mb.input_ids.shape, dtype=torch.float32, device=device)
    entropy = torch.zeros_like(logprobs)
    if pieces:
        logprobs = logprobs.index_put((rows, cols), torch.cat([lp for lp, _ in pieces]))
        entropy = entropy.index_put((rows, cols), torch.cat([e for _, e in pieces]))
    return logprobs, entropy


# Scored tokens projected to the vocabulary at once: 512 x 152k fp32 logits is ~0.3 GB, and a chunk
# big enough that the matmul stays efficient on a GPU.
LOGIT_CHUNK = 512


def _score_chunk(head: torch.nn.Module, states: torch.Tensor, tokens: torch.Tensor,
                 temperatures: torch.Tensor, top_ps: torch.Tensor,
                 any_nucleus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each token, entropy of its distribution) for one chunk of predicting states.

    A token sampled with top_p < 1 is scored within its nucleus, renormalised, as the engines record
    it: the nucleus is the engine's (`core.engine.sampling.nucleus`), chosen without gradient; the token itself is always
    counted in, so a token the policy has since pushed out of the nucleus stays finite."""
    logits = head(states).float() / temperatures[:, None]  # float32 so log_softmax keeps precision under bf16
    log_norm = torch.logsumexp(logits, dim=-1)
    with torch.no_grad():
        entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    nucleus = top_ps < 1.0
    # Only then a sort of the vocabulary, and only for those rows; `any_nucleus` (known on the host
    # when packing) spares the device read for a batch sampled without top_p.
    if any_nucleus and bool(nucleus.any()):
        with torch.no_grad():
            keep = nucleus_of(torch.softmax(logits[nucleus], dim=-1), top_ps[nucleus])
            keep.scatter_(1, tokens[nucleus, None], True)
        kept_norm = torch.logsumexp(logits[nucleus].masked_fill(~keep, float("-inf")), dim=-1)
        log_norm = log_norm.masked_scatter(nucleus, kept_norm)
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - log_norm
    return logprobs, entropy


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(f"the trainer scores the output embedding of the last hidden state; a model with "
                             f"{name}={getattr(config, name)} changes its logits after it, which is not supported")
    return model.get_decoder(), model.get_output_embeddings()
