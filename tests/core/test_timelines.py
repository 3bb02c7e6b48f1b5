"""Timeline merging on hand-built call logs: exact ids, masks, logprob alignment and token counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.records import Call
from core.train.prompt_sharing import share_prompt
from core.train.timelines import MERGE_MODES, Sample, merge_calls, merge_stats


def call(
    prompt: list[int],
    completion: list[int],
    logprobs: list[float] | None = None,
    *,
    version: int = 0,
    model: str = "policy",
) -> Call:
    if logprobs is None:
        logprobs = [-(t / 100) for t in completion]  # distinct per token so misalignment shows
    return Call(
        model=model, version=version, prompt_ids=prompt, completion_ids=completion, completion_logprobs=logprobs
    )


def masked(sample: Sample) -> list[tuple[int, int, float]]:
    """(position, token, logprob) of every loss position."""
    return [(i, t, lp) for i, (t, m, lp) in enumerate(zip(sample.input_ids, sample.loss_mask, sample.logprobs)) if m]


def total_masked(samples: list[Sample]) -> int:
    return sum(s.num_masked for s in samples)


# Three turns; every call's prompt re-presents the previous call's exact prompt + completion.
LINEAR = [
    call([1, 2, 3], [10, 11], [-0.1, -0.2], version=3),
    call([1, 2, 3, 10, 11, 4, 5], [12], [-0.3], version=4),
    call([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], [-0.4, -0.5], version=4),
]
# A retry: the second turn is sampled twice from the same context, then the episode goes on from neither.
BRANCHING = [
    call([1, 2, 3], [10, 11], [-0.1, -0.2]),
    call([1, 2, 3, 10, 11, 4], [20, 21], [-0.3, -0.4]),
    call([1, 2, 3, 10, 11, 4], [30], [-0.5]),
]
# Agents A (system prompt 100) and B (system prompt 200) alternate; B sees A's reply (10) as its prompt.
INTERLEAVED = [
    call([100, 1], [10], [-0.1]),
    call([200, 1, 10, 2], [20], [-0.2]),
    call([100, 1, 10, 3], [11], [-0.3]),
    call([200, 1, 10, 2, 20, 4], [21], [-0.4]),
]
# The second prompt re-tokenised the reply "11 12" as the single token 99: the trie diverges there.
DRIFTED = [
    call([1, 2], [10, 11, 12], [-0.1, -0.2, -0.3]),
    call([1, 2, 10, 99, 3], [13], [-0.4]),
]
EPISODES = {"linear": LINEAR, "branching": BRANCHING, "interleaved": INTERLEAVED, "drifted": DRIFTED}


def test_linear_episode_merges_into_one_sample_with_every_completion_masked() -> None:
    (s,) = merge_calls(LINEAR, "linear", episode_id="ep")
    assert s.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert s.loss_mask == [False, False, False, True, True, False, False, True, False, True, True]
    assert s.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert s.position_ids == list(range(11))
    assert s.parents is None
    assert (s.episode_id, s.advantage, s.weight, s.min_version) == ("ep", 0.0, 1.0, 3)


def test_linear_episode_packs_as_a_single_chain_in_tree_mode() -> None:
    (s,) = merge_calls(LINEAR, "tree")
    assert s.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert s.parents == [-1] + list(range(10))
    assert s.position_ids == list(range(11))
    assert masked(s) == [(3, 10, -0.1), (4, 11, -0.2), (7, 12, -0.3), (9, 13, -0.4), (10, 14, -0.5)]


def test_unmerged_mode_gives_one_sample_per_call_masked_on_its_own_completion() -> None:
    samples = merge_calls(LINEAR, "none")
    assert [s.input_ids for s in samples] == [
        [1, 2, 3, 10, 11],
        [1, 2, 3, 10, 11, 4, 5, 12],
        [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14],
    ]
    # The re-presented 10, 11 in later prompts are context there, not loss.
    assert [masked(s) for s in samples] == [
        [(3, 10, -0.1), (4, 11, -0.2)],
        [(7, 12, -0.3)],
        [(9, 13, -0.4), (10, 14, -0.5)],
    ]
    assert [s.min_version for s in samples] == [3, 4, 4]


def test_retry_branches_into_two_samples_and_the_shared_turn_trains_once() -> None:
    first, second = merge_calls(BRANCHING, "linear")
    assert first.input_ids == [1, 2, 3, 10, 11, 4, 20, 21]
    assert masked(first) == [(3, 10, -0.1), (4, 11, -0.2), (6, 20, -0.3), (7, 21, -0.4)]
    assert second.input_ids == [1, 2, 3, 10, 11, 4, 30]
    assert masked(second) == [(6, 30, -0.5)]


def test_retry_packs_as_a_tree_with_the_shared_prefix_once() -> None:
    (s,) = merge_calls(BRANCHING, "tree")
    assert s.input_ids == [1, 2, 3, 10, 11, 4, 20, 21, 30]
    assert s.parents == [-1, 0, 1, 2, 3, 4, 5, 6, 5]
    assert s.position_ids == [0, 1, 2, 3, 4, 5, 6, 7, 6]
    assert masked(s) == [(3, 10, -0.1), (4, 11, -0.2), (6, 20, -0.3), (7, 21, -0.4), (8, 30, -0.5)]


def test_interleaved_agents_form_two_lines_and_the_other_agents_reply_is_not_loss() -> None:
    line_a, line_b = merge_calls(INTERLEAVED, "linear")
    assert line_a.input_ids == [100, 1, 10, 3, 11]
    assert masked(line_a) == [(2, 10, -0.1), (4, 11, -0.3)]
    assert line_b.input_ids == [200, 1, 10, 2, 20, 4, 21]
    assert masked(line_b) == [(4, 20, -0.2), (6, 21, -0.4)]


def test_interleaved_agents_pack_as_a_forest_with_two_roots() -> None:
    (s,) = merge_calls(INTERLEAVED, "tree")
    assert s.input_ids == [100, 1, 10, 3, 11, 200, 1, 10, 2, 20, 4, 21]
    assert s.parents == [-1, 0, 1, 2, 3, -1, 5, 6, 7, 8, 9, 10]
    assert s.position_ids == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert [i for i, m in enumerate(s.loss_mask) if m] == [2, 4, 9, 11]


def test_drifted_token_splits_the_trie_and_both_branches_keep_their_generated_tokens() -> None:
    original, drifted = merge_calls(DRIFTED, "linear")
    assert original.input_ids == [1, 2, 10, 11, 12]
    assert masked(original) == [(2, 10, -0.1), (3, 11, -0.2), (4, 12, -0.3)]
    # The re-tokenised 99 was never sampled, so it is context; 10 already trained in the first branch.
    assert drifted.input_ids == [1, 2, 10, 99, 3, 13]
    assert masked(drifted) == [(5, 13, -0.4)]

    (tree,) = merge_calls(DRIFTED, "tree")
    assert tree.input_ids == [1, 2, 10, 11, 12, 99, 3, 13]
    assert tree.parents == [-1, 0, 1, 2, 3, 2, 5, 6]
    assert tree.position_ids == [0, 1, 2, 3, 4, 3, 4, 5]
    assert [i for i, m in enumerate(tree.loss_mask) if m] == [2, 3, 4, 7]


def test_a_token_one_call_generated_is_loss_even_where_another_call_had_it_as_prompt() -> None:
    calls = [call([1, 2, 3], [7], [-0.7]), call([1, 2], [3, 8], [-0.3, -0.8])]
    first, second = merge_calls(calls, "linear")
    assert masked(first) == [(2, 3, -0.3), (3, 7, -0.7)]
    assert masked(second) == [(3, 8, -0.8)]


def test_the_first_generation_of_a_token_keeps_its_logprob_and_version() -> None:
    # Both retries sampled 20 first; it trains once, with the first call's numbers.
    calls = [call([1, 2], [20, 21], [-0.2, -0.21], version=5), call([1, 2], [20, 22], [-0.9, -0.22], version=6)]
    (s,) = merge_calls(calls, "tree")
    assert masked(s) == [(2, 20, -0.2), (3, 21, -0.21), (4, 22, -0.22)]
    assert s.min_version == 5


@pytest.mark.parametrize("episode", list(EPISODES.values()), ids=list(EPISODES))
def test_every_mode_trains_each_completion_token_exactly_once(episode: list[Call]) -> None:
    completion_tokens = sum(len(c.completion_ids) for c in episode)
    for mode in MERGE_MODES:
        assert total_masked(merge_calls(episode, mode)) == completion_tokens, mode


@pytest.mark.parametrize("episode", list(EPISODES.values()), ids=list(EPISODES))
def test_stats_count_exactly_the_tokens_each_mode_emits(episode: list[Call]) -> None:
    stats = merge_stats(episode)
    emitted = {mode: sum(len(s.input_ids) for s in merge_calls(episode, mode)) for mode in MERGE_MODES}
    full_lengths = sum(len(c.prompt_ids) + len(c.completion_ids) for c in episode)
    assert stats["unmerged_tokens"] == emitted["none"] == full_lengths
    assert stats["linear_tokens"] == emitted["linear"]
    assert stats["tree_tokens"] == emitted["tree"]
    assert stats["masked_tokens"] == total_masked(merge_calls(episode, "tree"))
    assert stats["linear_samples"] == len(merge_calls(episode, "linear"))
    assert stats["ratio"] == pytest.approx(emitted["none"] / emitted["linear"])


def test_linear_merging_reaches_the_lower_bound_on_a_linear_episode() -> None:
    stats = merge_stats(LINEAR)
    assert stats["linear_tokens"] == stats["tree_tokens"] == 11
    assert stats["unmerged_tokens"] == 5 + 8 + 11
    assert stats["linear_efficiency"] == 1.0


def test_tree_packing_beats_linear_merging_on_a_branching_episode() -> None:
    stats = merge_stats(BRANCHING)
    assert stats["tree_tokens"] == 9 < stats["linear_tokens"] == 15 < stats["unmerged_tokens"] == 5 + 8 + 7


def test_empty_prompts_and_empty_completions_do_not_crash_and_train_nothing_unscorable() -> None:
    calls = [
        call([], [5, 6], [-0.5, -0.6]),  # the first token has no context to score it with
        call([1, 2], []),  # generated nothing
        call([], []),
    ]
    for mode in MERGE_MODES:
        samples = merge_calls(calls, mode)
        assert [masked(s) for s in samples] == [[(1, 6, -0.6)]], mode
        assert [s.input_ids for s in samples] == [[5, 6]], mode
    assert merge_calls([], "tree") == merge_calls([], "linear") == merge_calls([], "none") == []
    assert merge_stats(calls)["calls"] == 1
    assert merge_stats([])["ratio"] == 1.0


def test_trailing_context_after_the_last_generated_token_is_dropped() -> None:
    # The final call was cut off before generating: its new tool output trains nothing.
    calls = [call([1, 2], [10], [-0.1]), call([1, 2, 10, 3, 4], [])]
    for mode in ("linear", "tree"):
        (s,) = merge_calls(calls, mode)
        assert s.input_ids == [1, 2, 10], mode


def test_calls_of_several_models_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"\['critic', 'policy'\]"):
        merge_calls([call([1], [2]), call([1], [3], model="critic")], "linear")


def test_misaligned_or_non_finite_logprobs_are_refused_with_the_call_index() -> None:
    with pytest.raises(ValueError, match="call 1: 2 completion ids but 1 completion logprobs"):
        merge_calls([call([1], [2]), call([1], [2, 3], [-0.1])], "tree")
    with pytest.raises(ValueError, match="call 0: completion logprobs must be finite"):
        merge_stats([call([1], [2], [float("nan")])])


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown merge mode 'flat'"):
        merge_calls(LINEAR, "flat")  # type: ignore[arg-type]


def test_sample_with_mismatched_lengths_is_refused() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        Sample(input_ids=[1, 2], loss_mask=[True], logprobs=[0.0, 0.0], position_ids=[0, 1])


# --- property: on any episode, each distinct generated (context, token) trains exactly once ---------

TOKENS = st.integers(min_value=1, max_value=4)  # a tiny alphabet so branches collide and re-join


@st.composite
def episodes(draw: st.DrawFn) -> list[Call]:
    """Random multi-turn episodes: each call extends, retries from, or drifts off an earlier context."""
    calls: list[Call] = []
    for _ in range(draw(st.integers(1, 6))):
        if calls and draw(st.booleans()):
            base = draw(st.sampled_from(calls))
            full = base.prompt_ids + base.completion_ids
            prompt = full[: draw(st.integers(0, len(full)))] + draw(st.lists(TOKENS, max_size=3))
        else:
            prompt = draw(st.lists(TOKENS, max_size=4))
        completion = draw(st.lists(TOKENS, max_size=4))
        logprobs = [-draw(st.floats(0.01, 5.0)) for _ in completion]
        calls.append(call(prompt, completion, logprobs))
    return calls


def generated_prefixes(calls: list[Call]) -> dict[tuple[int, ...], float]:
    """Every scorable generated token, keyed by its full context + itself, first generator's logprob."""
    out: dict[tuple[int, ...], float] = {}
    for c in calls:
        full = c.prompt_ids + c.completion_ids
        for k, lp in enumerate(c.completion_logprobs):
            pos = len(c.prompt_ids) + k
            if pos > 0:
                out.setdefault(tuple(full[: pos + 1]), lp)
    return out


def trained(samples: list[Sample]) -> list[tuple[tuple[int, ...], float, float, float]]:
    """(full context + token, behaviour logprob, advantage, weight) of every trained token."""
    out = []
    for s in samples:
        predictors, advantages, weights = s.predictors(), s.token_advantages(), s.token_weights()
        for i in range(len(s.input_ids)):
            if not s.loss_mask[i]:
                continue
            chain, j = [], i
            while j >= 0:
                chain.append(s.input_ids[j])
                j = predictors[j]
            context = chain[::-1]
            assert s.position_ids[i] == len(context) - 1
            out.append((tuple(context), s.logprobs[i], advantages[i], weights[i]))
    return out


def trained_prefixes(samples: list[Sample]) -> list[tuple[tuple[int, ...], float]]:
    return [(context, logprob) for context, logprob, _, _ in trained(samples)]


@settings(max_examples=200, deadline=None)
@given(episodes())
def test_merged_modes_train_each_generated_token_once_with_its_own_logprob(calls: list[Call]) -> None:
    expected = generated_prefixes(calls)
    for mode in ("linear", "tree"):
        trained = trained_prefixes(merge_calls(calls, mode))
        assert sorted(trained) == sorted(expected.items()), mode
    stats = merge_stats(calls)
    assert stats["tree_tokens"] <= stats["linear_tokens"] <= stats["unmerged_tokens"]
    assert stats["masked_tokens"] == len(expected)


# --- sharing a group's prompt: fewer tokens, every trained token as it was ----------------------------


@st.composite
def groups(draw: st.DrawFn) -> list[list[Call]]:
    """Episodes of one task: random episodes whose every call starts with the task's prompt."""
    prompt = draw(st.lists(TOKENS, min_size=1, max_size=5))
    return [[c.model_copy(update={"prompt_ids": prompt + c.prompt_ids}) for c in draw(episodes())]
            for _ in range(draw(st.integers(1, 5)))]


@settings(max_examples=200, deadline=None)
@given(groups(), st.sampled_from(MERGE_MODES), st.integers(1, 60))
def test_a_shared_prompt_keeps_every_trained_token_with_its_context_advantage_and_weight(
    group: list[list[Call]], mode: str, max_tokens: int
) -> None:
    samples = []
    for i, calls in enumerate(group):
        for s in merge_calls(calls, mode, episode_id=f"e{i}"):
            s.advantage, s.weight = float(i) - 1.5, 1.0 / (i + 1)  # distinct per episode
            samples.append(s)
    shared = share_prompt(samples, max_tokens)
    assert sorted(trained(shared)) == sorted(trained(samples))
    assert sum(len(s.input_ids) for s in shared) <= sum(len(s.input_ids) for s in samples)
    for s in shared:
        assert all(-1 <= p < j for j, p in enumerate(s.predictors()))  # still a tree, parents first
        if len(s.input_ids) > max_tokens:  # only a sample over the budget on its own may exceed it
            assert s in samples


def test_a_group_of_one_prompt_holds_it_once_in_one_tree_sample() -> None:
    prompt = [1, 2, 3, 4, 5]
    samples = [merge_calls([call(prompt, [10 + i, 20 + i])], "linear", episode_id=f"e{i}")[0] for i in range(4)]
    for i, s in enumerate(samples):
        s.advantage = float(i)
    (shared,) = share_prompt(samples, max_tokens=4096)
    assert shared.input_ids == prompt + [10, 20, 11, 21, 12, 22, 13, 23]
    assert shared.parents == [-1, 0, 1, 2, 3, 4, 5, 4, 7, 4, 9, 4, 11]  # every answer hangs off the prompt's end
    assert shared.position_ids == [0, 1, 2, 3, 4, 5, 6, 5, 6, 5, 6, 5, 6]
    assert shared.advantages == [0.0] * 5 + [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert shared.episode_id == "e0,e1,e2,e3" and shared.num_masked == 8


def test_prompts_that_differ_from_the_first_token_are_left_alone() -> None:
    samples = [merge_calls([call([t, 2, 3], [10])], "linear")[0] for t in (1, 7)]
    assert share_prompt(samples, max_tokens=4096) == samples


def test_a_budget_splits_the_group_and_each_part_holds_the_prompt_once() -> None:
    prompt = [1, 2, 3, 4]
    samples = [merge_calls([call(prompt, [10 + i, 20 + i])], "linear")[0] for i in range(5)]
    shared = share_prompt(samples, max_tokens=len(prompt) + 4)  # room for two answers of 2 tokens
    assert [len(s.input_ids) for s in shared] == [8, 8, 6]
    assert [s.input_ids[:4] for s in shared] == [prompt] * 3
