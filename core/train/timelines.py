"""Timeline merging: one episode's recorded calls for one model -> training samples.

Every call of the episode is inserted into a token prefix tree (trie): a node is one token at one
position of one context, so calls that share a token prefix share nodes, and a token that several
calls re-present (token-in-token-out) is stored once. A node is *generated* when some call sampled
that token there; it then carries the behaviour logprob, the sampling temperature that logprob is
of, and the weight version of the first call that did, and how many calls sampled it (two choices
of `n = 2` that share a prefix): the loss weighs it by that count, so every mode trains what
``none`` trains. Three merge modes read the same trie:

- ``none``: one sample per call, prompt + completion, loss on the completion (the baseline).
- ``linear``: one sample per leaf path. A call whose sequence is a prefix of another's folds into
  it; divergent branches (retries, drift, interleaved agents) become separate samples that repeat
  their shared prefix, but every generated token is in the loss of exactly one sample.
- ``tree``: the whole trie in one sequence in depth-first order, with each token's parent index
  and depth, so a tree attention mask processes every unique token once (the lower bound).

Deliberate choices:

- The loss mask holds only tokens this model sampled: never template, prompt, tool-output or other
  agents' tokens, even where those re-present generated text elsewhere in the trie.
- EOS is trained when the engine sampled it (it is then part of ``completion_ids``), so the model
  learns when to stop; a template end-of-turn token added after a length-capped reply is not.
- A generated token with no token before it (a call with an empty prompt) cannot be scored by a
  causal forward pass, so it stays out of the loss.
- Tokens after the last generated token of a path carry no gradient and are left out, as are calls
  that generated nothing.

Across episodes, ``share_prompt`` (``core.train.prompt_sharing``) packs the samples of one group (episodes of one task, so the
same prompt) into tree samples that hold their common untrained prefix once: a GRPO group of 8
re-presents the same prompt 8 times, and with short completions the prompt is most of the tokens.
Only untrained tokens are shared; generated tokens never are, since two episodes' copies of a token
carry different advantages and the clipped PPO term is not additive across them.

This module is pure Python. It does not pad, batch or touch a model (see ``core.train.packing``),
and it does not compute advantages (the trainer sets ``Sample.advantage``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from core.records import Call

MergeMode = Literal["none", "linear", "tree"]
MERGE_MODES: tuple[MergeMode, ...] = ("none", "linear", "tree")

# Index of the trie's virtual root; real nodes start at 1 so a node's parent is always a smaller index.
_ROOT = 0
# Version stored on nodes nobody generated; never read for the loss.
_NO_VERSION = -1


@dataclass
class Sample:
    """One training sequence. All per-token lists have the same length."""

    input_ids: list[int]
    loss_mask: list[bool]  # True exactly on tokens this model generated
    logprobs: list[float]  # behaviour logprob of input_ids[i] given its context; 0.0 off the mask
    position_ids: list[int]  # 0..n-1 for linear samples; depth in the tree for tree samples
    parents: list[int] | None = None  # tree samples: index of each token's parent, -1 for roots
    episode_id: str = ""
    advantage: float = 0.0  # set by the trainer from the episode's group
    weight: float = 1.0  # per-sample loss weight (episode weighting)
    # Per-token advantage and weight, for samples holding several episodes (`share_prompt`); None
    # means `advantage` and `weight` on every token.
    advantages: list[float] | None = None
    weights: list[float] | None = None
    min_version: int | None = None  # oldest weight version that generated a masked token
    # Temperature each token's behaviour logprob is of, so the trainer scores it the same way;
    # 1.0 off the mask. None means 1.0 everywhere.
    temperatures: list[float] | None = None
    # Nucleus mass each token was sampled within (top_p); its behaviour logprob is of the renormalised
    # nucleus, and the trainer scores it the same way. 1.0 off the mask. None means 1.0 everywhere.
    top_ps: list[float] | None = None
    # How many of the episode's samples produced each token (n > 1 choices, retries that sample the
    # same text): merged, such a token is held once but must weigh as often as mode "none" trains
    # it, so that every merge mode gives the same loss and gradient. None means 1 everywhere.
    counts: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        per_token = ("loss_mask", "logprobs", "position_ids", "parents", "advantages", "weights", "temperatures",
                     "top_ps", "counts")
        lengths = {name: len(getattr(self, name)) for name in per_token if getattr(self, name) is not None}
        if self.temperatures is not None and any(not t > 0 for t in self.temperatures):
            raise ValueError("sample temperatures must be positive")
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"sample has {n} input_ids but mismatched lengths {bad}")

    @property
    def num_masked(self) -> int:
        """Trained tokens as mode "none" counts them: a token that several samples produced counts each time."""
        if self.counts is None:
            return sum(self.loss_mask)
        return sum(c for c, m in zip(self.counts, self.loss_mask) if m)

    def token_advantages(self) -> list[float]:
        return self.advantages if self.advantages is not None else [self.advantage] * len(self.input_ids)

    def token_weights(self) -> list[float]:
        """Each token's loss weight: `weights` when set, else `weight` times the token's count."""
        if self.weights is not None:
            return self.weights
        return [self.weight * c for c in self.counts] if self.counts is not None else [self.weight] * len(self.input_ids)

    def predictors(self) -> list[int]:
        """Index of the token whose context predicts each token: its parent in a tree, else the one before."""
        return list(self.parents) if self.parents is not None else list(range(-1, len(self.input_ids) - 1))


class MergeStats(TypedDict):
    """Token counts of each merge mode for one episode (lower is less training compute)."""

    calls: int  # calls that generated at least one trainable token
    unmerged_tokens: int  # tokens of mode "none": each such call's full prompt + completion
    linear_tokens: int  # tokens of mode "linear"
    tree_tokens: int  # unique trie tokens on a path to a generated token: the lower bound
    masked_tokens: int  # trainable (loss-masked) tokens; the same in linear and tree mode
    linear_samples: int  # branches of the episode
    ratio: float  # unmerged / linear: the speed-up of linear merging (the `merge/ratio` metric)
    tree_ratio: float  # unmerged / tree: the speed-up of tree packing
    linear_efficiency: float  # tree / linear: how close linear merging gets to the lower bound


@dataclass
class _Trie:
    """Parallel arrays, one entry per node; index 0 is the virtual root."""

    token: list[int] = field(default_factory=lambda: [-1])
    parent: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [-1])
    masked: list[bool] = field(default_factory=lambda: [False])
    logprob: list[float] = field(default_factory=lambda: [0.0])
    version: list[int] = field(default_factory=lambda: [_NO_VERSION])
    temperature: list[float] = field(default_factory=lambda: [1.0])
    top_p: list[float] = field(default_factory=lambda: [1.0])
    count: list[int] = field(default_factory=lambda: [0])  # calls that sampled this token here
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    def insert(self, call: Call) -> None:
        """Walk the call's sequence from the root, adding nodes it does not share; O(its length)."""
        n_prompt = len(call.prompt_ids)
        node = _ROOT
        for k, tok in enumerate(_full_sequence(call)):
            child = self.children[node].get(tok)
            if child is None:
                child = len(self.token)
                self.children[node][tok] = child
                self.token.append(tok)
                self.parent.append(node)
                self.depth.append(self.depth[node] + 1)
                self.masked.append(False)
                self.logprob.append(0.0)
                self.version.append(_NO_VERSION)
                self.temperature.append(1.0)
                self.top_p.append(1.0)
                self.count.append(0)
                self.children.append({})
            # The first call to sample this token here owns its logprob; a prompt that merely
            # re-presents it (or a later identical sample) does not change it. Roots (depth 0)
            # have no context to score them with.
            if k >= n_prompt and self.depth[child] > 0:
                self.count[child] += 1
            if k >= n_prompt and not self.masked[child] and self.depth[child] > 0:
                self.masked[child] = True
                self.logprob[child] = call.completion_logprobs[k - n_prompt]
                self.version[child] = call.version
                self.temperature[child] = call.temperature
                self.top_p[child] = call.top_p
            node = child

    def useful(self) -> list[bool]:
        """Nodes that are generated or lead to a generated node; the rest carry no gradient."""
        useful = list(self.masked)
        # Children always have larger indices than their parents, so one reverse sweep suffices.
        for node in range(len(useful) - 1, 0, -1):
            if useful[node]:
                useful[self.parent[node]] = True
        useful[_ROOT] = False
        return useful

    def depth_first(self, useful: list[bool]) -> Iterator[tuple[int, bool]]:
        """Yield (node, is_leaf) for useful nodes in depth-first order, children in insertion order."""
        stack = [c for c in reversed(self.children[_ROOT].values()) if useful[c]]
        while stack:
            node = stack.pop()
            kids = [c for c in self.children[node].values() if useful[c]]
            yield node, not kids
            stack.extend(reversed(kids))


def _full_sequence(call: Call) -> list[int]:
    return call.prompt_ids + call.completion_ids


def _validate(calls: Sequence[Call]) -> None:
    models = {c.model for c in calls}
    if len(models) > 1:
        raise ValueError(
            f"merge_calls takes the calls of one model, got calls of {sorted(models)}; "
            "split them with Episode.calls_of(model)"
        )
    for i, call in enumerate(calls):
        if len(call.completion_logprobs) != len(call.completion_ids):
            raise ValueError(
                f"call {i}: {len(call.completion_ids)} completion ids but "
                f"{len(call.completion_logprobs)} completion logprobs"
            )
        if not all(math.isfinite(lp) for lp in call.completion_logprobs):
            raise ValueError(f"call {i}: completion logprobs must be finite (a NaN or inf would poison the loss)")
        if not (math.isfinite(call.temperature) and call.temperature > 0):
            raise ValueError(
                f"call {i}: temperature {call.temperature} is not a positive number (greedy calls record 1.0)"
            )


def _build_trie(calls: Sequence[Call]) -> _Trie:
    _validate(calls)
    trie = _Trie()
    for call in calls:
        trie.insert(call)
    return trie


def _unmerged(calls: Sequence[Call], episode_id: str) -> list[Sample]:
    samples = []
    for call in calls:
        ids = _full_sequence(call)
        n_prompt = len(call.prompt_ids)
        # Position 0 has no context, so a generated token there is not trainable (see module doc).
        mask = [i >= max(n_prompt, 1) for i in range(len(ids))]
        if not any(mask):
            continue
        logprobs = [0.0] * n_prompt + list(call.completion_logprobs)
        logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, mask)]
        samples.append(
            Sample(
                input_ids=ids,
                loss_mask=mask,
                logprobs=logprobs,
                position_ids=list(range(len(ids))),
                episode_id=episode_id,
                min_version=call.version,
                temperatures=[call.temperature if m else 1.0 for m in mask],
                top_ps=[call.top_p if m else 1.0 for m in mask],
            )
        )
    return samples


def _min_version(trie: _Trie, nodes: list[int]) -> int | None:
    versions = [trie.version[n] for n in nodes if trie.masked[n]]
    return min(versions) if versions else None


def _linear(trie: _Trie, episode_id: str) -> list[Sample]:
    samples = []
    claimed = [False] * len(trie.token)
    path: list[int] = []
    for node, is_leaf in trie.depth_first(trie.useful()):
        del path[trie.depth[node] :]
        path.append(node)
        if not is_leaf:
            continue
        # A generated token shared by several branches trains once: in the first branch that reaches it.
        mask = [trie.masked[n] and not claimed[n] for n in path]
        for n, m in zip(path, mask):
            claimed[n] = claimed[n] or m
        samples.append(
            Sample(
                input_ids=[trie.token[n] for n in path],
                loss_mask=mask,
                logprobs=[trie.logprob[n] if m else 0.0 for n, m in zip(path, mask)],
                position_ids=list(range(len(path))),
                episode_id=episode_id,
                min_version=_min_version(trie, [n for n, m in zip(path, mask) if m]),
                temperatures=[trie.temperature[n] if m else 1.0 for n, m in zip(path, mask)],
                top_ps=[trie.top_p[n] if m else 1.0 for n, m in zip(path, mask)],
                counts=[trie.count[n] if m else 1 for n, m in zip(path, mask)],
            )
        )
    return samples


def _tree(trie: _Trie, episode_id: str) -> list[Sample]:
    order = [node for node, _ in trie.depth_first(trie.useful())]
    if not order:
        return []
    packed_index = {node: i for i, node in enumerate(order)}
    return [
        Sample(
            input_ids=[trie.token[n] for n in order],
            loss_mask=[trie.masked[n] for n in order],
            logprobs=[trie.logprob[n] for n in order],
            position_ids=[trie.depth[n] for n in order],
            parents=[packed_index.get(trie.parent[n], -1) for n in order],
            episode_id=episode_id,
            min_version=_min_version(trie, order),
            temperatures=[trie.temperature[n] if trie.masked[n] else 1.0 for n in order],
            top_ps=[trie.top_p[n] if trie.masked[n] else 1.0 for n in order],
            counts=[trie.count[n] if trie.masked[n] else 1 for n in order],
        )
    ]


def merge_calls(calls: Sequence[Call], mode: MergeMode, episode_id: str = "") -> list[Sample]:
    """Turn one episode's calls of ONE model, in call order, into training samples.

    Raises ValueError for calls of several models, misaligned or non-finite logprobs, or an
    unknown mode. An episode that generated nothing trainable gives an empty list.
    """
    return merge_with_stats(calls, mode, episode_id, with_stats=False)[0]


def merge_with_stats(calls: Sequence[Call], mode: MergeMode, episode_id: str = "",
                     with_stats: bool = True) -> tuple[list[Sample], MergeStats | None]:
    """`merge_calls` and `merge_stats` from one trie build: the trainer wants both for every episode."""
    if mode not in MERGE_MODES:
        raise ValueError(f"unknown merge mode {mode!r}; expected one of {MERGE_MODES}")
    if mode == "none" and not with_stats:
        _validate(calls)
        return _unmerged(calls, episode_id), None
    trie = _build_trie(calls)
    unmerged = _unmerged(calls, episode_id)
    stats = _stats(trie, unmerged) if with_stats else None
    if mode == "none":
        return unmerged, stats
    return (_linear(trie, episode_id) if mode == "linear" else _tree(trie, episode_id)), stats


def _ratio(num: int, den: int) -> float:
    # An episode with nothing to train costs nothing in any mode: call that no speed-up.
    return num / den if den else 1.0


def merge_stats(calls: Sequence[Call]) -> MergeStats:
    """How many tokens each merge mode would train on for this episode, from one trie build."""
    return _stats(_build_trie(calls), _unmerged(calls, ""))


def _stats(trie: _Trie, unmerged_samples: list[Sample]) -> MergeStats:
    useful = trie.useful()
    unmerged = sum(len(s.input_ids) for s in unmerged_samples)
    linear = tree = leaves = 0
    for node, is_leaf in trie.depth_first(useful):
        tree += 1
        if is_leaf:
            leaves += 1
            linear += trie.depth[node] + 1
    return MergeStats(
        calls=len(unmerged_samples),
        unmerged_tokens=unmerged,
        linear_tokens=linear,
        tree_tokens=tree,
        masked_tokens=sum(trie.masked),
        linear_samples=leaves,
        ratio=_ratio(unmerged, linear),
        tree_ratio=_ratio(unmerged, tree),
        linear_efficiency=_ratio(tree, linear),
    )
