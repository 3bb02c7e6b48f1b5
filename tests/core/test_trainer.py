"""The trainer step on the tiny model: it learns, it is exact under packing, and it refuses bad input.

Episodes are hand-built: fixed completions whose behaviour logprobs come from a forward pass of the
current policy, exactly what an on-policy engine would have recorded.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import core.train.timelines as timelines
import core.train.trainer as trainer_module
from core.config import LoraConfig, TrainerConfig
from core.models import build_tiny, byte_tokenizer, prepare_policy
from core.records import Call, Episode
from core.train.mismatch import MismatchExceeded
from core.train.trainer import Trainer, seed_everything

MODEL = "policy"
PROMPT = "<|im_start|>user\nwrite\n<|im_end|>\n<|im_start|>assistant\n"
# Rewarded by how many 'x' bytes they hold; each group sees all four.
CANDIDATES = ["xxab", "abab", "xbxa", "baba"]


TOKENIZER = byte_tokenizer()  # the tiny model's tokenizer; built once, never mutated


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def eos_id() -> int:
    return TOKENIZER.eos_token_id


def behaviour_logprobs(model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """log p(completion token | everything before it) under `model`, as the engine records it."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt_ids) + i - 1, t].item() for i, t in enumerate(completion_ids)]


def completion_logprob(model: torch.nn.Module, text: str, prompt: str = PROMPT) -> float:
    return sum(behaviour_logprobs(model, encode(prompt), encode(text) + [eos_id()]))


def make_call(model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], version: int = 0) -> Call:
    return Call(
        model=MODEL,
        version=version,
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completion_logprobs=behaviour_logprobs(model, prompt_ids, completion_ids),
    )


def make_episode(
    model: torch.nn.Module,
    episode_id: str,
    completions: list[str],
    reward: float,
    task_id: str = "t0",
    group_size: int = 4,
) -> Episode:
    """An episode of one call per completion; each later call continues the earlier conversation."""
    calls, context = [], encode(PROMPT)
    for text in completions:
        completion = encode(text) + [eos_id()]
        calls.append(make_call(model, context, completion))
        context = context + completion + encode("\n<|im_start|>user\nmore\n<|im_end|>\n<|im_start|>assistant\n")
    return Episode(
        id=episode_id,
        sandbox="bytes",
        task_id=task_id,
        group_size=group_size,
        state="finished",
        opened_at=0.0,
        lease_expires_at=60.0,
        calls=calls,
        reward={MODEL: reward},
    )


def x_groups(model: torch.nn.Module, n_groups: int = 2, step: int = 0) -> list[list[Episode]]:
    """Groups over CANDIDATES, rewarded by the share of 'x' bytes, with on-policy logprobs."""
    return [
        [
            make_episode(model, f"s{step}-g{g}-e{i}", [text], text.count("x") / len(text), task_id=f"t{g}")
            for i, text in enumerate(CANDIDATES)
        ]
        for g in range(n_groups)
    ]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> set[str]:
    return {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}


def tiny_trainer(lora: LoraConfig | None = None, **overrides) -> Trainer:
    seed_everything(0)  # LoRA's initial adapter weights come from the global RNG
    model, _ = build_tiny(seed=0)
    cfg = TrainerConfig(lr=overrides.pop("lr", 3e-3), **overrides)
    return Trainer(prepare_policy(model, lora), cfg, MODEL, lora=lora is not None)


def test_rewarded_completion_becomes_more_likely_after_a_few_steps():
    trainer = tiny_trainer()
    rewarded_before = completion_logprob(trainer.policy, "xxxx")
    unrewarded_before = completion_logprob(trainer.policy, "baba")
    for step in range(6):
        metrics = trainer.step(x_groups(trainer.policy, step=step))
        assert metrics["train/skipped"] == 0.0
    rewarded_gain = completion_logprob(trainer.policy, "xxxx") - rewarded_before
    unrewarded_gain = completion_logprob(trainer.policy, "baba") - unrewarded_before
    # "xxxx" was never sampled: the policy learned that 'x' bytes pay, not one string.
    assert rewarded_gain > 2.0
    assert rewarded_gain > unrewarded_gain + 2.0
    assert trainer.step_count == 6


def test_lora_training_moves_only_the_adapters_and_learns():
    trainer = tiny_trainer(LoraConfig(r=4, alpha=8), lr=2e-2)
    before = weights(trainer.policy)
    rewarded_before = completion_logprob(trainer.policy, "xxxx")
    unrewarded_before = completion_logprob(trainer.policy, "baba")
    for step in range(6):
        trainer.step(x_groups(trainer.policy, step=step))
    moved = changed(before, trainer.policy)
    assert moved and all("lora_" in name for name in moved)
    rewarded_gain = completion_logprob(trainer.policy, "xxxx") - rewarded_before
    unrewarded_gain = completion_logprob(trainer.policy, "baba") - unrewarded_before
    assert rewarded_gain > unrewarded_gain + 1.0


def test_metrics_report_rewards_merge_ratio_and_tokens():
    trainer = tiny_trainer()
    # Two-call episodes: the second call's prompt extends the first call, so linear merging halves the work.
    group = [
        make_episode(trainer.policy, f"e{i}", ["ab", text], reward=float(i), task_id="multi", group_size=2)
        for i, text in enumerate(["xy", "yz"])
    ]
    metrics = trainer.step([group])
    assert metrics["reward/mean"] == pytest.approx(0.5)
    assert metrics["reward/std"] == pytest.approx(0.5)
    assert metrics["reward/bytes/mean"] == pytest.approx(0.5)
    assert 1.4 < metrics["merge/ratio"] < 2.0  # the first call's tokens are not trained twice
    assert metrics["train/samples"] == 2.0  # one merged sample per episode
    assert metrics["train/trained_tokens"] == 2 * (3 + 3)  # two replies of 2 bytes + EOS each
    assert metrics["train/clip_frac"] == 0.0  # on-policy: every ratio is 1
    # The behaviour logprobs came from this model in fp32: trainer and "engine" agree to rounding.
    assert 0.0 <= metrics["train/behaviour_logp_diff"] <= metrics["train/behaviour_logp_diff_max"] < 1e-4
    assert metrics["train/entropy"] > 0.0
    assert metrics["train/grad_norm"] > 0.0
    for name in ("train/loss", "train/kl", "train/tokens", "train/step_time_s"):
        assert math.isfinite(metrics[name])


def test_groups_with_equal_rewards_leave_the_weights_alone_but_count_as_a_step():
    trainer = tiny_trainer()
    before = weights(trainer.policy)
    groups = [[make_episode(trainer.policy, f"e{i}", [t], reward=1.0) for i, t in enumerate(CANDIDATES)]]
    metrics = trainer.step(groups)
    assert changed(before, trainer.policy) == set()
    assert metrics["reward/mean"] == 1.0
    assert metrics["train/tokens"] == 0.0  # nothing could move, so nothing was run through the model
    assert metrics["train/skipped"] == 0.0
    assert metrics["train/updated"] == 0.0  # so the run loop keeps the weight version
    assert trainer.step_count == 1


def test_micro_batch_budget_does_not_change_the_update():
    results = []
    for budget in (16, 4096):
        # share_prompt off: a 16-token budget has no room to share the prompt, 4096 would.
        trainer = tiny_trainer(micro_batch_tokens=budget, kl_coef=0.05, share_prompt=False)
        groups = x_groups(trainer.policy)
        metrics = trainer.step(groups)
        results.append((weights(trainer.policy), metrics))
    (small_w, small_m), (big_w, big_m) = results
    assert small_m["train/loss"] == pytest.approx(big_m["train/loss"], abs=1e-6)
    # The pre-clip norm is read off the accumulated gradient: the same gradient, however packed.
    assert small_m["train/grad_norm"] == pytest.approx(big_m["train/grad_norm"], rel=1e-5)
    # Adam's first step is ~lr * sign(grad), so float noise on near-zero gradients may flip an
    # element's sign; anything beyond that noise (an lr-sized 3e-3) would be a real difference.
    for name in small_w:
        torch.testing.assert_close(small_w[name], big_w[name], rtol=0, atol=1e-5)


def test_merge_modes_train_the_same_tokens_to_the_same_gradient():
    # Every generated token is trained once, in the same context, whether calls are kept apart,
    # merged into lines or packed as a tree; only the work differs.
    results = {}
    for mode in ("none", "linear", "tree"):
        trainer = tiny_trainer(merge=mode, share_prompt=False)  # the modes' own token counts
        chain = make_episode(trainer.policy, "chain", ["ab", "xy", "c"], reward=1.0, group_size=2)
        # A retry: the same prompt answered twice, so the episode branches after the prompt.
        retry = make_episode(trainer.policy, "retry", ["ab"], reward=0.0, group_size=2)
        prompt = retry.calls[0].prompt_ids
        retry.calls.append(make_call(trainer.policy, prompt, encode("yz") + [eos_id()]))
        results[mode] = trainer.step([[chain, retry]])
    assert {m["train/trained_tokens"] for m in results.values()} == {14.0}
    for mode in ("linear", "tree"):
        assert results[mode]["train/grad_norm"] == pytest.approx(results["none"]["train/grad_norm"], rel=1e-4)
        assert results[mode]["train/loss"] == pytest.approx(results["none"]["train/loss"], abs=1e-6)
    assert results["tree"]["train/tokens"] < results["linear"]["train/tokens"] < results["none"]["train/tokens"]


def test_tokens_two_samples_both_produced_weigh_twice_in_every_merge_mode():
    # n = 2: two choices of one request that begin with the same generated text. Merged, the shared
    # tokens are held once; they must still weigh as in mode "none", which trains each choice apart.
    results = {}
    for mode in ("none", "linear", "tree"):
        for share in (False, True):
            trainer = tiny_trainer(merge=mode, share_prompt=share)
            first = make_episode(trainer.policy, "n2", ["abcd"], reward=1.0, group_size=2)
            first.calls.append(make_call(trainer.policy, first.calls[0].prompt_ids, encode("abxy") + [eos_id()]))
            other = make_episode(trainer.policy, "n2", ["z"], reward=0.0, group_size=2)
            results[mode, share] = trainer.step([[first, other]])
    none = results["none", False]
    assert none["train/trained_tokens"] == 12.0  # 5 + 5 + 2 tokens through the model
    assert results["tree", False]["train/trained_tokens"] == 10.0  # the shared "ab" held once
    for key, got in results.items():
        assert got["train/loss"] == pytest.approx(none["train/loss"], abs=1e-6), key
        assert got["train/grad_norm"] == pytest.approx(none["train/grad_norm"], rel=1e-4), key


def test_a_groups_shared_prompt_trains_to_the_same_gradient_on_fewer_tokens():
    # Two groups of four one-call episodes, with episode weighting so advantages and weights both vary.
    results = {}
    for share in (False, True):
        trainer = tiny_trainer(share_prompt=share, episode_weighting=True, kl_coef=0.05)
        results[share] = (trainer.step(x_groups(trainer.policy)), weights(trainer.policy))
    (plain, plain_w), (shared, shared_w) = results[False], results[True]
    assert shared["train/loss"] == pytest.approx(plain["train/loss"], abs=1e-6)
    assert shared["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-4)
    assert shared["train/kl"] == pytest.approx(plain["train/kl"], abs=1e-6)
    assert shared["train/trained_tokens"] == plain["train/trained_tokens"]
    prompt = len(encode(PROMPT))  # held once per group instead of once per episode: 3 of 4 copies saved
    assert shared["train/tokens"] == plain["train/tokens"] - 2 * 3 * prompt
    # A tree mask sums attention in another order than the causal path, and Adam's first step turns
    # a float-noise difference on a near-zero gradient into up to ~lr/100; a real one is lr (3e-3).
    for name in plain_w:
        torch.testing.assert_close(shared_w[name], plain_w[name], rtol=0, atol=1e-4)


def test_episode_weighting_gives_every_episode_the_same_say():
    # On-policy the ratio is 1, so the loss is -(weighted mean advantage over tokens). GRPO advantages
    # of a group sum to zero, so with equal episode weights the loss is zero whatever the lengths.
    losses = {}
    for weighting in (False, True):
        trainer = tiny_trainer(episode_weighting=weighting)
        group = [
            make_episode(trainer.policy, "long", ["xxxxxxxxxxxx"], reward=1.0, group_size=2),
            make_episode(trainer.policy, "short", ["b"], reward=0.0, group_size=2),
        ]
        losses[weighting] = trainer.step([group])["train/loss"]
    assert losses[True] == pytest.approx(0.0, abs=1e-6)
    # Token weighting: 13 tokens at advantage +1 against 2 tokens at -1.
    assert losses[False] == pytest.approx(-(13 - 2) / 15, abs=1e-4)


def test_kl_to_the_reference_starts_at_zero_and_grows_as_the_policy_moves():
    for lora in (None, LoraConfig(r=4, alpha=8)):
        trainer = tiny_trainer(lora, lr=2e-2, kl_coef=0.1)
        first = trainer.step(x_groups(trainer.policy, step=0))
        assert first["train/kl"] == pytest.approx(0.0, abs=1e-7)
        for step in range(1, 4):
            last = trainer.step(x_groups(trainer.policy, step=step))
        assert last["train/kl"] > 1e-5, f"lora={lora is not None}"


def test_stale_behaviour_logprobs_are_clipped():
    trainer = tiny_trainer(clip_low=0.1, clip_high=0.1)
    groups = x_groups(trainer.policy)
    for group in groups:
        for episode in group:
            for call in episode.calls:
                # As if an older policy had sampled these tokens far less eagerly: ratios far above 1+clip.
                call.completion_logprobs = [lp - 1.0 for lp in call.completion_logprobs]
    metrics = trainer.step(groups)
    # Positive-advantage tokens sit above 1 + clip_high and pass no gradient; negative ones still do.
    assert metrics["train/clip_frac"] == pytest.approx(0.5)
    assert metrics["train/behaviour_logp_diff"] == pytest.approx(1.0, abs=1e-4)  # the gap put in above


def test_non_finite_loss_skips_the_optimizer_step(caplog: pytest.LogCaptureFixture):
    trainer = tiny_trainer()
    groups = x_groups(trainer.policy)
    with torch.no_grad():
        trainer.policy.model.norm.weight[0] = float("nan")
    before = weights(trainer.policy)
    with caplog.at_level(logging.WARNING, logger="core.train.trainer"):
        metrics = trainer.step(groups)
    assert metrics["train/skipped"] == 1.0 and metrics["train/updated"] == 0.0
    assert "optimizer step skipped" in caplog.text
    assert trainer.optimizer.state == {}  # AdamW never stepped, so no moments were built
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert changed(before, trainer.policy) <= {"model.norm.weight"}  # the NaN itself compares unequal
    # Once the weights are healthy again the next step trains normally.
    with torch.no_grad():
        trainer.policy.model.norm.weight[0] = 1.0
    healthy = trainer.step(x_groups(trainer.policy))
    assert healthy["train/skipped"] == 0.0 and healthy["train/updated"] == 1.0
    assert trainer.step_count == 2


def test_truncated_importance_sampling_trains_stale_tokens_the_clip_would_drop():
    seen = {}
    for name, trainer in (("clip", tiny_trainer(clip_low=0.1, clip_high=0.1)),
                          ("tis", tiny_trainer(clip_low=0.1, clip_high=0.1, tis_cap=2.0))):
        groups = x_groups(trainer.policy)
        for group in groups:
            for episode in group:
                for call in episode.calls:
                    call.completion_logprobs = [lp - 1.0 for lp in call.completion_logprobs]  # ratio e > cap
        seen[name] = trainer.step(groups)
    assert seen["clip"]["train/clip_frac"] == pytest.approx(0.5)
    # Every token's ratio (e) is above the cap, so every one is weighted by the cap and none is dropped.
    assert seen["tis"]["train/clip_frac"] == pytest.approx(1.0)
    assert seen["tis"]["train/updated"] == 1.0 and seen["tis"]["train/grad_norm"] > 0.0


def test_one_group_with_a_reward_beyond_max_abs_reward_never_voids_the_step():
    trainer = tiny_trainer()
    before = weights(trainer.policy)
    groups = x_groups(trainer.policy, n_groups=2)
    groups[1][0].reward = {MODEL: 1e308}  # arrived past the finish check (an old checkpoint's buffer, say)
    metrics = trainer.step(groups)
    assert metrics["train/skipped"] == 0.0 and metrics["train/updated"] == 1.0
    assert changed(before, trainer.policy)  # the healthy group trained


def test_a_step_builds_each_episodes_trie_once_and_reads_each_micro_batch_in_one_host_sync(monkeypatch):
    trainer = tiny_trainer(merge="tree", micro_batch_tokens=64)  # small budget: several micro-batches
    groups = x_groups(trainer.policy)
    builds, syncs, micro_batches = [], [], []
    build = timelines._build_trie
    monkeypatch.setattr(timelines, "_build_trie", lambda calls: builds.append(calls) or build(calls))
    pack = trainer_module.pack
    monkeypatch.setattr(trainer_module, "pack", lambda *a: [micro_batches.append(mb) or mb for mb in pack(*a)])
    accumulate = trainer._accumulate

    def counting(*args):  # host syncs only while micro-batches run: forward, loss, backward
        for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name,
                                lambda self, *a, _o=original, _n=name: syncs.append(_n) or _o(self, *a))
        try:
            return accumulate(*args)
        finally:
            monkeypatch.undo()

    trainer._accumulate = counting
    trainer.step(groups)
    assert len(builds) == sum(len(g) for g in groups)  # one build per episode, not one per use
    assert len(micro_batches) > 1
    assert len(syncs) == len(micro_batches), syncs


def hot_episodes(model: torch.nn.Module, temperature: float) -> list[list[Episode]]:
    """Episodes as an engine that samples at `temperature` but records its calls as T = 1 would log them:
    the logprobs are of softmax(logits / temperature), the calls say temperature 1."""
    def at(prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + completion_ids])).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return [logp[len(prompt_ids) + i - 1, t].item() for i, t in enumerate(completion_ids)]

    group = []
    for i, text in enumerate(CANDIDATES):
        episode = make_episode(model, f"hot-{i}", [text], text.count("x") / len(text))
        call = episode.calls[0]
        call.completion_logprobs = at(call.prompt_ids, call.completion_ids)
        group.append(episode)
    return [group]


def test_the_mismatch_warning_fires_when_the_engine_samples_at_another_temperature_than_it_records(
        caplog: pytest.LogCaptureFixture):
    trainer = tiny_trainer(mismatch_kl_bound=0.01)
    with caplog.at_level(logging.WARNING, logger="core.train.mismatch"):
        honest = trainer.step(x_groups(trainer.policy))
    assert honest["train/mismatch_kl"] < 1e-6 and honest["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert "mismatch KL" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="core.train.mismatch"):
        hot = trainer.step(hot_episodes(trainer.policy, temperature=0.5))
    assert hot["train/mismatch_kl"] > 0.01
    assert "mismatch KL" in caplog.text and "exceeds trainer.mismatch_kl_bound 0.01" in caplog.text
    assert hot["train/updated"] == 1.0  # `warn` only warns


def test_mismatch_action_stop_fails_the_step_before_the_weights_change():
    trainer = tiny_trainer(mismatch_kl_bound=0.01, mismatch_action="stop")
    before = weights(trainer.policy)
    with pytest.raises(MismatchExceeded, match="mismatch_action is stop"):
        trainer.step(hot_episodes(trainer.policy, temperature=0.5))
    assert changed(before, trainer.policy) == set()


def test_token_mis_counts_its_dropped_tokens_in_the_step_metrics():
    trainer = tiny_trainer(correction="token_mis", tis_cap=1.05)
    metrics = trainer.step(hot_episodes(trainer.policy, temperature=0.5))
    assert 0.0 < metrics["train/masked_frac"] <= 1.0
    plain = tiny_trainer().step(hot_episodes(tiny_trainer().policy, temperature=0.5))
    assert plain["train/masked_frac"] == 0.0


def test_turn_credit_gives_each_turn_its_own_advantage_and_trains():
    trainer = tiny_trainer(credit="turn", advantage="rloo")
    # Episodes 0 and 1 ran two turns, 2 and 3 one; rewards 1, 0, 0, 0.5 (docs/architecture.md's estimator).
    texts = [["xxab", "xbxa"], ["abab", "baba"], ["baba"], ["xbab"]]
    group = [make_episode(trainer.policy, f"e{i}", t, r) for i, (t, r) in enumerate(zip(texts, [1.0, 0.0, 0.0, 0.5]))]
    prepared = trainer.prepare([group])
    by_episode: dict[str, list[float]] = {}
    for s in prepared.samples:
        by_episode.setdefault(s.episode_id, []).append(s.advantage)
    # Turn 0: the mean of the three others; turn 1: of the others that reached turn 1 (episode 0 <-> 1).
    assert by_episode["e0"] == pytest.approx([1.0 - 0.5 / 3, 1.0 - 0.0])
    assert by_episode["e1"] == pytest.approx([0.0 - 1.5 / 3, 0.0 - 1.0])
    assert by_episode["e3"] == pytest.approx([0.5 - 1.0 / 3])
    trainer.backward(prepared)
    assert trainer.apply(prepared)


@pytest.mark.parametrize("settings, key", [({"correction": "token_mis"}, "tis_cap"),
                                           ({"correction": "seq_tis"}, "tis_cap"),
                                           ({"loss": "cispo", "tis_cap": 2.0}, "cispo"),
                                           ({"credit": "turn", "advantage": "reinforce_pp"}, "credit")])
def test_options_that_do_not_fit_together_are_refused_at_load_naming_the_key(settings, key):
    with pytest.raises(ValueError, match=key):
        TrainerConfig(**settings)
