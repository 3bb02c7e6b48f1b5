"""Prompt sharing across a group: the samples of one GRPO group packed into tree samples that hold their common untrained prefix once.

The episodes of a group share their task's prompt, and with short completions the prompt is most
of the tokens, so holding it once cuts the forward pass by up to the group size. Only untrained
tokens are shared; generated tokens never are, since two episodes' copies of a token carry different
advantages and the clipped PPO term is not additive across them. Every token keeps its context,
position, temperature, advantage and weight, so the loss and its gradient are unchanged.

This module only rearranges `Sample`s; it does not merge calls (``core.train.timelines``) or pad
and batch (``core.train.packing``).
"""

from __future__ import annotations

from collections.abc import Sequence

from core.train.timelines import Sample


def _untrained_chain(sample: Sample) -> int:
    """Length of the sample's leading run of untrained tokens that form a plain line (0, 1, 2, ...)."""
    predictors = sample.predictors()
    n = 0
    while (n < len(sample.input_ids) and not sample.loss_mask[n] and sample.position_ids[n] == n
           and predictors[n] == n - 1):
        n += 1
    return n


def _common_prefix(samples: Sequence[Sample]) -> int:
    """Tokens every sample starts with that are untrained and in a line: the part that can be held once."""
    n = min(_untrained_chain(s) for s in samples)
    first = samples[0].input_ids
    for s in samples[1:]:
        n = next((i for i in range(n) if s.input_ids[i] != first[i]), n)
    return n


def _shared(samples: Sequence[Sample], prefix: int) -> Sample:
    """One tree sample: `prefix` tokens once, then each sample's remaining tokens hanging off them."""
    ids = list(samples[0].input_ids[:prefix])
    mask, logprobs, positions = [False] * prefix, [0.0] * prefix, list(range(prefix))
    parents, temperatures, top_ps = list(range(-1, prefix - 1)), [1.0] * prefix, [1.0] * prefix
    advantages, weights = [0.0] * prefix, [0.0] * prefix  # untrained tokens: never read by the loss
    for s in samples:
        offset = len(ids) - prefix  # where this sample's token `prefix` lands, less `prefix`
        predictors = s.predictors()
        ids += s.input_ids[prefix:]
        mask += s.loss_mask[prefix:]
        logprobs += s.logprobs[prefix:]
        positions += s.position_ids[prefix:]
        parents += [q if q < prefix else q + offset for q in predictors[prefix:]]
        temperatures += (s.temperatures or [1.0] * len(s.input_ids))[prefix:]
        top_ps += (s.top_ps or [1.0] * len(s.input_ids))[prefix:]
        advantages += s.token_advantages()[prefix:]
        weights += s.token_weights()[prefix:]
    versions = [s.min_version for s in samples if s.min_version is not None]
    return Sample(input_ids=ids, loss_mask=mask, logprobs=logprobs, position_ids=positions, parents=parents,
                  episode_id=",".join(dict.fromkeys(s.episode_id for s in samples)),
                  min_version=min(versions) if versions else None, temperatures=temperatures, top_ps=top_ps,
                  advantages=advantages, weights=weights)


def share_prompt(samples: Sequence[Sample], max_tokens: int) -> list[Sample]:
    """The samples of one group with their common untrained prefix held once, in tree samples.

    Samples are taken in order into tree samples of at most `max_tokens` tokens each (a sample longer
    than that stays as it is). Every token keeps its context, position, temperature, advantage and
    weight, so the loss and its gradient are those of the unshared samples. Samples with no common
    prefix come back unchanged.
    """
    if len(samples) < 2:
        return list(samples)
    prefix = _common_prefix(samples)
    if prefix == 0:
        return list(samples)
    chunks: list[list[Sample]] = [[]]
    size = prefix
    for s in samples:
        if chunks[-1] and size + len(s.input_ids) - prefix > max_tokens:
            chunks.append([])
            size = prefix
        chunks[-1].append(s)
        size += len(s.input_ids) - prefix
    return [_shared(chunk, prefix) if len(chunk) > 1 else chunk[0] for chunk in chunks]
