"""Packing samples into micro-batches, and scoring them with a real (tiny, random) Llama.

The model checks compare against the plain way: each call's own sequence, alone, through the model.
Merged and packed scoring must give the same logprob for every token.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import transformers.integrations.flex_attention
from torch.nn.attention.flex_attention import BlockMask
from transformers import LlamaConfig, LlamaForCausalLM

from core.records import Call
from core.train.timelines import Sample, merge_calls
from core.models import attention_view
from core.train.attention import dense_tree_mask, flex_tree_mask, tree_attention_mask
from core.train.packing import MicroBatch, pack, token_logprobs

VOCAB = 300
TOLERANCE = 1e-4


def tiny_llama(attn_implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, so the mask must survive repeat_kv
        max_position_embeddings=256,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request: pytest.FixtureRequest) -> LlamaForCausalLM:
    return tiny_llama(request.param)


def sequence_logprobs(model: LlamaForCausalLM, ids: list[int]) -> tuple[list[float], list[float]]:
    """Reference: logprob of ids[i] given ids[:i], and the entropy predicting it, one unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return [0.0] + [logp[i - 1, ids[i]].item() for i in range(1, len(ids))], [0.0] + entropy[:-1].tolist()


def scored_episode(model: LlamaForCausalLM, shapes: list[tuple[list[int], list[int]]]) -> list[Call]:
    """Calls whose behaviour logprobs are the model's own, as an on-policy engine would record them."""
    calls = []
    for prompt, completion in shapes:
        lps, _ = sequence_logprobs(model, prompt + completion)
        calls.append(
            Call(
                model="policy",
                version=0,
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=lps[len(prompt) :],
            )
        )
    return calls


def context_of(sample: Sample, i: int) -> tuple[int, ...]:
    if sample.parents is None:
        return tuple(sample.input_ids[: i + 1])
    chain = []
    while i >= 0:
        chain.append(sample.input_ids[i])
        i = sample.parents[i]
    return tuple(chain[::-1])


def reference_table(model: LlamaForCausalLM, calls: list[Call]) -> dict[tuple[int, ...], tuple[float, float]]:
    """(context + token) -> (logprob, entropy) for every token of every call, scored alone."""
    table = {}
    for c in calls:
        ids = c.prompt_ids + c.completion_ids
        lps, ents = sequence_logprobs(model, ids)
        for i in range(1, len(ids)):
            table[tuple(ids[: i + 1])] = (lps[i], ents[i])
    return table


# Random token ids in episode shapes: a retry, two interleaved agents and a drifted re-tokenisation.
_g = torch.Generator().manual_seed(7)


def _ids(n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=_g).tolist()


SYS_A, SYS_B, USER, TOOL, TOOL2 = _ids(6), _ids(5), _ids(4), _ids(3), _ids(2)
REPLY_A1, REPLY_B1, REPLY_A2, RETRY = _ids(5), _ids(4), _ids(3), _ids(6)
EPISODE = [
    (SYS_A + USER, REPLY_A1),
    (SYS_B + USER + REPLY_A1, REPLY_B1),  # agent B reads A's reply as its prompt
    (SYS_A + USER + REPLY_A1 + TOOL, REPLY_A2),
    (SYS_A + USER + REPLY_A1 + TOOL, RETRY),  # a retry of A's second turn
    (SYS_A + USER + REPLY_A1[:3] + [7] + TOOL2, _ids(4)),  # drift: A's reply re-tokenised from its 4th token
]


@pytest.mark.parametrize("mode", ["tree", "linear", "none"])
def test_packed_logprobs_equal_each_calls_own_logprobs(model: LlamaForCausalLM, mode: str) -> None:
    calls = scored_episode(model, EPISODE)
    reference = reference_table(model, calls)
    samples = merge_calls(calls, mode)
    checked = 0
    for mb in pack(samples, token_budget=4096):
        with torch.no_grad():
            logprobs, entropy = token_logprobs(model, mb)
        # On the loss positions the fresh logprobs equal the recorded behaviour logprobs...
        assert torch.allclose(logprobs[mb.loss_mask], mb.old_logprobs[mb.loss_mask], atol=TOLERANCE)
        # ...and every real position with a predictor matches the call-by-call reference.
        for row, sample_index in enumerate(mb.rows):
            sample = samples[sample_index]
            for i in range(len(sample.input_ids)):
                if mb.predictor_index[row, i] < 0:
                    assert logprobs[row, i] == 0.0 and entropy[row, i] == 0.0
                    continue
                want_lp, want_ent = reference[context_of(sample, i)]
                assert math.isclose(logprobs[row, i].item(), want_lp, abs_tol=TOLERANCE)
                assert math.isclose(entropy[row, i].item(), want_ent, abs_tol=TOLERANCE)
                checked += 1
    roots = sum(s.parents.count(-1) if s.parents is not None else 1 for s in samples)
    assert checked == sum(len(s.input_ids) for s in samples) - roots


def test_linear_and_tree_samples_share_a_micro_batch(model: LlamaForCausalLM) -> None:
    calls = scored_episode(model, EPISODE)
    samples = merge_calls(calls, "linear") + merge_calls(calls, "tree")
    (mb,) = pack(samples, token_budget=10_000)
    assert mb.is_tree and len(mb.rows) == len(samples)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, mb)
    assert torch.allclose(logprobs[mb.loss_mask], mb.old_logprobs[mb.loss_mask], atol=TOLERANCE)


def test_packed_logprobs_carry_gradient_to_the_weights(model: LlamaForCausalLM) -> None:
    calls = scored_episode(model, EPISODE[:2])
    (mb,) = pack(merge_calls(calls, "tree"), token_budget=4096)
    model.zero_grad()
    logprobs, entropy = token_logprobs(model, mb)
    assert not entropy.requires_grad
    logprobs[mb.loss_mask].sum().backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad()


def test_tree_batches_refuse_attention_without_custom_mask_support() -> None:
    (mb,) = pack(merge_calls(scored_episode(tiny_llama("sdpa"), EPISODE[:2]), "tree"), token_budget=4096)
    with pytest.raises(ValueError, match="'flash_attention_2'"):
        tree_attention_mask(mb.predictor_index, "flash_attention_2", torch.float32, flex=True)


# Hand-built, parents first but not depth-first: 0 -> {1, 2}, 1 -> 3. Node 1's subtree {1, 3} is not
# one range of positions, so FlexAttention falls back to the dense mask for it.
NOT_PREORDER = Sample(input_ids=[11, 12, 13, 14], loss_mask=[False, True, True, True], logprobs=[0.0] * 4,
                      position_ids=[0, 1, 1, 2], parents=[-1, 0, 0, 1])


def test_the_flex_block_mask_is_the_dense_tree_mask() -> None:
    calls = scored_episode(tiny_llama("sdpa"), EPISODE)
    (mb,) = pack(merge_calls(calls, "tree") + merge_calls(calls, "linear"), token_budget=10_000)
    block = flex_tree_mask(mb.predictor_index)
    assert isinstance(block, BlockMask)
    b, t = mb.input_ids.shape
    rows, q, kv = torch.arange(b)[:, None, None], torch.arange(t)[None, :, None], torch.arange(t)[None, None, :]
    assert torch.equal(block.mask_mod(rows, 0, q, kv), dense_tree_mask(mb.predictor_index)[:, 0])
    (odd,) = pack([NOT_PREORDER], token_budget=16)
    assert flex_tree_mask(odd.predictor_index) is None


def test_flex_attention_gives_the_dense_masks_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FlexAttention path (GPU) against the dense one (CPU), same weights, on the CPU, forward only:
    torch 2.13 has no FlexAttention backward on the CPU, which is why the CPU trains with the dense mask.

    transformers compiles flex_attention with inductor before its first call: minutes of C++ builds on
    a CPU runner, and what a GPU does anyway. Here torch's eager flex_attention runs instead: the same
    operator and block mask, without the compiled kernel.
    """
    monkeypatch.setattr(transformers.integrations.flex_attention, "is_torchdynamo_compiling", lambda: True)
    dense, loaded_flex = tiny_llama("sdpa"), tiny_llama("flex_attention")
    calls = scored_episode(dense, EPISODE)
    samples = merge_calls(calls, "tree") + merge_calls(calls, "linear") + [NOT_PREORDER]
    batches = pack(samples, token_budget=10_000)
    assert [mb.is_tree for mb in batches] == [True]
    with torch.no_grad():
        for mb in batches:
            want, want_entropy = token_logprobs(dense, mb, flex=False)
            for model, flex in ((dense, True), (loaded_flex, None)):  # switched for the call, or loaded so
                got, got_entropy = token_logprobs(model, mb, flex=flex)
                assert torch.allclose(got, want, atol=TOLERANCE)
                assert torch.allclose(got_entropy, want_entropy, atol=TOLERANCE)
    assert dense.config._attn_implementation == "sdpa"  # put back after the call
    (linear,) = pack(merge_calls(calls, "linear"), token_budget=10_000)
    with torch.no_grad():  # a block mask, not the dense fallback, on the preorder rows
        block_mask, implementation = tree_attention_mask(linear.predictor_index, "sdpa", torch.float32, flex=True)
    assert isinstance(block_mask, BlockMask) and implementation == "flex_attention"


def test_a_tree_forward_under_flex_never_changes_the_kernel_the_engine_decodes_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer scores a tree batch with flex_attention while the engine decodes with the same module.

    A hook holds the trainer inside its forward pass until the engine has run one of its own, so the
    overlap is certain, not a matter of timing; the engine's attention must still see its own kernel.
    """
    monkeypatch.setattr(transformers.integrations.flex_attention, "is_torchdynamo_compiling", lambda: True)
    model = tiny_llama("sdpa")
    calls = scored_episode(model, EPISODE)
    (mb,) = pack(merge_calls(calls, "tree"), token_budget=10_000)
    seen: list[tuple[str, str]] = []
    trainer_inside, engine_done = threading.Event(), threading.Event()

    def hook(module: torch.nn.Module, args: tuple) -> None:
        seen.append((threading.current_thread().name, module.config._attn_implementation))
        if threading.current_thread().name == "trainer" and not engine_done.is_set():
            trainer_inside.set()
            engine_done.wait(30)

    model.model.layers[0].self_attn.register_forward_pre_hook(hook)

    def engine() -> None:
        assert trainer_inside.wait(30)
        with torch.no_grad():
            model(input_ids=torch.tensor([SYS_A + USER]))
        engine_done.set()

    def trainer() -> None:
        with torch.no_grad():
            token_logprobs(model, mb, flex=True)

    threads = [threading.Thread(target=engine, name="engine"), threading.Thread(target=trainer, name="trainer")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert engine_done.is_set()
    assert {impl for who, impl in seen if who == "engine"} == {"sdpa"}
    assert {impl for who, impl in seen if who == "trainer"} == {"flex_attention"}
    assert model.config._attn_implementation == "sdpa"


def test_the_trainers_attention_view_shares_the_models_parameters_and_gradients() -> None:
    model = tiny_llama("sdpa")
    view = attention_view(model, "eager")
    assert view is attention_view(model, "eager") and attention_view(model, "sdpa") is model
    assert all(a is b for a, b in zip(model.parameters(), view.parameters()))
    ids = torch.tensor([SYS_A + USER])
    torch.testing.assert_close(view(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
    view(input_ids=ids).logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def linear_sample(n: int, *, advantage: float = 0.0, weight: float = 1.0) -> Sample:
    return Sample(
        input_ids=list(range(1, n + 1)),
        loss_mask=[i > 0 for i in range(n)],
        logprobs=[-1.0] * n,
        position_ids=list(range(n)),
        advantage=advantage,
        weight=weight,
    )


def test_micro_batches_stay_within_the_budget_and_hold_every_sample_once() -> None:
    lengths = [9, 3, 7, 2, 5, 5, 1, 8, 4]
    samples = [linear_sample(n) for n in lengths]
    batches = pack(samples, token_budget=16)
    assert sorted(r for mb in batches for r in mb.rows) == list(range(len(samples)))
    for mb in batches:
        assert mb.padded_tokens <= 16
        assert mb.input_ids.shape == (len(mb.rows), max(lengths[r] for r in mb.rows))
        assert mb.lengths == [lengths[r] for r in mb.rows]
    assert sum(mb.num_tokens for mb in batches) == sum(lengths)


def test_a_sample_longer_than_the_budget_is_its_own_micro_batch() -> None:
    batches = pack([linear_sample(3), linear_sample(40), linear_sample(2)], token_budget=8)
    big = [mb for mb in batches if 1 in mb.rows]
    assert len(big) == 1 and big[0].rows == [1] and big[0].padded_tokens == 40
    assert sorted(r for mb in batches for r in mb.rows) == [0, 1, 2]


def test_padding_is_inert_and_per_sample_values_broadcast() -> None:
    (mb,) = pack([linear_sample(4, advantage=0.5, weight=2.0), linear_sample(2, advantage=-1.0)], token_budget=100)
    assert mb.rows == [0, 1] and not mb.is_tree
    assert mb.input_ids.tolist() == [[1, 2, 3, 4], [1, 2, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert mb.loss_mask.tolist() == [[False, True, True, True], [False, True, False, False]]
    assert mb.advantages.tolist() == [[0.5] * 4, [-1.0, -1.0, 0.0, 0.0]]
    assert mb.weights.tolist() == [[2.0] * 4, [1.0, 1.0, 0.0, 0.0]]
    assert mb.old_logprobs.tolist() == [[-1.0] * 4, [-1.0, -1.0, 0.0, 0.0]]
    assert mb.predictor_index.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1]]


def test_tree_mask_lets_each_token_see_exactly_itself_and_its_ancestors() -> None:
    # 0 -> 1 -> 2, 1 -> 3 (a branch), 4 a second root; then one padding position.
    tree = Sample(
        input_ids=[5, 6, 7, 8, 9],
        loss_mask=[False, True, True, True, False],
        logprobs=[0.0] * 5,
        position_ids=[0, 1, 2, 2, 0],
        parents=[-1, 0, 1, 1, -1],
    )
    (mb,) = pack([tree, linear_sample(6)], token_budget=100)
    assert mb.rows == [1, 0]  # longest first
    mask = dense_tree_mask(mb.predictor_index)
    assert mask.shape == (2, 1, 6, 6)
    assert mask[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees only itself, so no attention row is empty
    ]
    assert torch.equal(mask[0, 0], torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert mb.predictor_index[1].tolist() == [-1, 0, 1, 1, -1, -1]
    assert mb.position_ids[1].tolist() == [0, 1, 2, 2, 0, 0]


@pytest.mark.parametrize(
    ("samples", "budget", "message"),
    [
        ([linear_sample(3)], 0, "token_budget must be at least 1"),
        ([linear_sample(3), Sample([], [], [], [])], 8, "sample 1 .* is empty"),
        ([Sample([1, -2], [False, True], [0.0, 0.0], [0, 1])], 8, "negative token id"),
        ([Sample([1, 2, 3], [False] * 3, [0.0] * 3, [0, 1, 1], parents=[-1, 2, 0])], 8, r"violated at positions \[1\]"),
    ],
)
def test_bad_samples_are_refused_before_anything_is_built(samples: list[Sample], budget: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack(samples, token_budget=budget)


def test_micro_batch_moves_to_a_device_whole() -> None:
    (mb,) = pack([linear_sample(3)], token_budget=8)
    moved = mb.to("cpu")
    assert isinstance(moved, MicroBatch) and moved.rows == mb.rows and torch.equal(moved.input_ids, mb.input_ids)
