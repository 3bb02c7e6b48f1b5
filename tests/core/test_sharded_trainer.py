"""The FSDP2 trainer (core/train/sharded.py) with 2 real rank processes on gloo and the tiny model.

One step's summed gradient, gathered from the shards, equals a single trainer's on the same batch;
the weights after the step agree; a checkpoint written by fsdp2 at world size 2 resumes at world
size 1 and the other way; ranks whose shares need different numbers of micro-batches still finish
the step (each test has a timeout: a mismatch would hang in a collective); an fsdp2 checkpoint
resumes on replicated ranks too; a state that does not fit is refused before any rank changes; a
killed rank fails the step naming it.

Tolerance, as in tests/core/test_distributed_trainer.py: float32 on CPU, the ranks pack the samples
into different micro-batches and the reduce-scatter adds in another order, so gradients agree to
rtol 1e-4, atol 1e-6. Weights after an AdamW step are compared with that file's `assert_steps_agree`
(all within 2·lr, all but 0.1 % within 1e-5), since AdamW may flip an element whose gradient lies
within the reordering noise of zero: no assertion depends on one CPU's rounding.

One fsdp2 trainer at a time per process (it holds torch.distributed's default group), so each test
closes the one it built.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from core.config import ModelConfig, TrainerConfig
from core.models import build_tiny
from core.run import checkpoint
from core.train.distributed import DistributedTrainer
from core.train.packing import micro_batch_count
from core.train.ranks import RankError, balance
from core.train import sharded_checkpoint
from core.train.sharded import ShardedTrainer
from core.train.trainer import Trainer, seed_everything
from tests.core.test_distributed_trainer import (
    CFG,
    GRAD_ATOL,
    GRAD_RTOL,
    assert_steps_agree,
    grads,
    groups_for,
)
from tests.core.test_trainer import MODEL, make_episode

# Each test spawns a rank (imports torch and transformers: ~20 s on a loaded 2-core box) and trains a
# step or two of the tiny model; a hang in a collective would otherwise wait RANK_TIMEOUT_S (600 s).
pytestmark = pytest.mark.timeout(300)

MC = ModelConfig(name=MODEL, device="cpu")
KILL_AFTER_S = 2.0  # a step of the tiny model takes ~0.5-1 s here, most of it in FSDP's collectives
KL_SEED = 7  # a tiny model other than the one the rank processes load (the preset's seed 0)
MAX_STEPS_BEFORE_KILL = 1000  # far more than 2 s of steps: the loop ends by the kill's RankError


@contextmanager
def sharded(model: torch.nn.Module, cfg: TrainerConfig = CFG) -> Iterator[ShardedTrainer]:
    """A 2-rank fsdp2 trainer, closed after (one at a time per process: it holds the default group)."""
    trainer = ShardedTrainer(model, cfg, MC, ["cpu", "cpu"])
    try:
        yield trainer
    finally:
        trainer.close()


def assert_grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def assert_weights_agree(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p1), p2 in zip(a.named_parameters(), b.parameters()):
        assert_steps_agree(p2, p1, name)


def assert_same_step(single: Trainer, one, fsdp: ShardedTrainer, two) -> None:
    """Both run the backward of their prepared step: the gradient gathered from the shards equals the
    single trainer's; both step: rank 0's full module (what engines read) agrees with the single one."""
    single.backward(one)
    fsdp.backward(two)
    assert_grads_match(fsdp.gradients(), grads(single))
    assert single.apply(one) and fsdp.apply(two)
    assert_weights_agree(single.policy, fsdp.policy)


def test_two_shards_sum_to_the_single_rank_gradient_and_step():
    seed_everything(0)
    base, _ = build_tiny(0)
    single = Trainer(copy.deepcopy(base), CFG, MODEL, lora=False)
    with sharded(copy.deepcopy(base)) as fsdp:
        batch = groups_for(base)
        one, two = single.prepare(batch), fsdp.prepare(batch)
        assert one.normalizer == two.normalizer  # one normaliser over the whole batch, not per rank
        assert_same_step(single, one, fsdp, two)
        assert two.sums["masked"] == one.sums["masked"] and two.sums["tokens"] == one.sums["tokens"]
        assert two.sums["loss"] == pytest.approx(one.sums["loss"], rel=1e-5)
        assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)  # the global norm, not a shard's
        assert any(not torch.equal(p, q) for p, q in zip(fsdp.policy.parameters(), base.parameters()))  # gathered


def test_the_kl_term_scores_against_rank_0s_reference_on_every_rank():
    seed_everything(0)
    base, _ = build_tiny(KL_SEED)  # rank 1 loads the preset's seed 0: its own model is not this one
    cfg = CFG.model_copy(update={"kl_coef": 0.1})
    single = Trainer(copy.deepcopy(base), cfg, MODEL, lora=False)
    with sharded(copy.deepcopy(base), cfg) as fsdp:
        batch = groups_for(base)
        for t in (single, fsdp):  # a first step moves the policy off the reference: the KL term then pulls
            t.step(batch)
        one, two = single.prepare(batch), fsdp.prepare(batch)
        assert_same_step(single, one, fsdp, two)  # rank 1's KL gradient is against rank 0's reference
        assert one.sums["kl"] > 0 and two.sums["kl"] == pytest.approx(one.sums["kl"], rel=1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """After the same step from the same weights: a single trainer's checkpoint and an fsdp2 one's."""
    seed_everything(0)
    base, _ = build_tiny(0)
    single = Trainer(copy.deepcopy(base), CFG, MODEL, lora=False)
    with sharded(copy.deepcopy(base)) as fsdp:
        batch = groups_for(base)
        for t in (single, fsdp):
            t.step(batch)
        fsdp_path = checkpoint.save(tmp_path_factory.mktemp("fsdp2"), 1, {MODEL: fsdp}, [], {MODEL: 1}, {})
    single_path = checkpoint.save(tmp_path_factory.mktemp("single"), 1, {MODEL: single}, [], {MODEL: 1}, {})
    return single_path, fsdp_path, batch


def continued(path, trainer: Trainer, batch) -> dict[str, float]:
    """`trainer` restored from the checkpoint at `path`, then one more step on `batch`."""
    checkpoint.restore(checkpoint.load(path), {MODEL: trainer})
    assert trainer.step_count == 1
    return trainer.step(batch)


def test_a_checkpoint_written_by_fsdp2_at_two_ranks_resumes_at_one_and_the_runs_agree(checkpoints):
    single_path, fsdp_path, batch = checkpoints
    saved = torch.load(fsdp_path / "models" / MODEL / checkpoint.TRAINER_STATE, weights_only=True)
    assert "optimizer" not in saved and saved["step"] == 1  # the moments are each rank's DCP shards
    reference, resumed = (Trainer(build_tiny(0)[0], CFG, MODEL, lora=False) for _ in range(2))
    m1, m2 = continued(single_path, reference, batch), continued(fsdp_path, resumed, batch)
    assert m2["train/updated"] == 1.0 and m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-4)
    assert_weights_agree(reference.policy, resumed.policy)  # same weights and AdamW state were saved


def test_an_fsdp2_checkpoint_resumes_on_replicated_ranks(checkpoints):
    single_path, fsdp_path, batch = checkpoints
    reference = Trainer(build_tiny(0)[0], CFG, MODEL, lora=False)
    replicated = DistributedTrainer(build_tiny(0)[0], CFG, MC, ["cpu", "cpu"])
    try:
        m1, m2 = continued(single_path, reference, batch), continued(fsdp_path, replicated, batch)
        assert m2["train/updated"] == 1.0 and m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-4)
        assert_weights_agree(reference.policy, replicated.policy)
    finally:
        replicated.close()


def test_an_fsdp2_checkpoint_resumes_on_fsdp2_ranks_each_reading_its_shards(checkpoints):
    single_path, fsdp_path, batch = checkpoints
    assert sorted(p.name for p in (fsdp_path / "models" / MODEL / "sharded").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # DCP: one shard file a rank
    reference = Trainer(build_tiny(0)[0], CFG, MODEL, lora=False)
    with sharded(build_tiny(0)[0]) as again:
        m1, m2 = continued(single_path, reference, batch), continued(fsdp_path, again, batch)
        assert m2["train/updated"] == 1.0 and m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-4)
        assert_weights_agree(reference.policy, again.policy)


def test_a_one_rank_checkpoint_loads_into_fsdp2_and_reaches_every_shard(tmp_path):
    seed_everything(0)
    trained = Trainer(build_tiny(0)[0], CFG, MODEL, lora=False)
    trained.step(groups_for(trained.policy))
    path = checkpoint.save(tmp_path, 1, {MODEL: trained}, [], {MODEL: 1}, {})
    with sharded(build_tiny(0)[0]) as fsdp:
        checkpoint.restore(checkpoint.load(path), {MODEL: fsdp})
        assert fsdp.step_count == 1
        batch = groups_for(trained.policy)
        # Rank 1 computes its share on its shard of the checkpoint's weights (had it kept the initial
        # ones, the summed gradient would differ), and the AdamW moments reached the shards too (a
        # fresh optimizer's first step differs by ~lr).
        assert_same_step(trained, trained.prepare(batch), fsdp, fsdp.prepare(batch))


def test_a_bf16_model_steps_fp32_master_shards_and_a_sharded_checkpoint_of_them_resumes_at_one_rank(tmp_path):
    seed_everything(0)
    bf16 = ModelConfig(name=MODEL, device="cpu", dtype="bfloat16")  # the ranks load the model in it too
    fsdp = ShardedTrainer(build_tiny(0)[0].to(torch.bfloat16), CFG, bf16, ["cpu", "cpu"])
    try:
        assert fsdp.step(groups_for(fsdp.policy))["train/updated"] == 1.0
        path = checkpoint.save(tmp_path, 1, {MODEL: fsdp}, [], {MODEL: 1}, {})  # the copies as DCP shards
        saved = fsdp.state_dict()["master"]  # and gathered whole, to compare
    finally:
        fsdp.close()
    params = list(build_tiny(0)[0].parameters())
    assert [m.shape for m in saved] == [p.shape for p in params] and all(m.dtype == torch.float32 for m in saved)
    one = Trainer(build_tiny(0)[0].to(torch.bfloat16), CFG, MODEL, lora=False)
    checkpoint.restore(checkpoint.load(path), {MODEL: one})
    for (_, m), s in zip(one.master.pairs, saved):  # the fp32 bits the bf16 weights lost came back
        assert torch.equal(m, s)
    for p, (_, m) in zip(one.policy.parameters(), one.master.pairs):
        assert torch.equal(p, m.to(torch.bfloat16))  # and the gathered weights are their rounding


def test_shares_needing_different_micro_batch_counts_finish_the_step():
    seed_everything(0)
    base, _ = build_tiny(0)
    cfg = CFG.model_copy(update={"micro_batch_tokens": 16})
    single = Trainer(copy.deepcopy(base), cfg, MODEL, lora=False)
    # One long episode and several short ones: the token balance gives one rank the long sample alone
    # (one micro-batch) and the other the short ones (several at a 16-token budget).
    long_turns = ["xxab" * 3] * 3
    groups = [[make_episode(base, "long", long_turns, 1.0, task_id="t"),
               make_episode(base, "short0", ["ab"], 0.0, task_id="t"),
               make_episode(base, "short1", ["xa"], 2.0, task_id="t"),
               make_episode(base, "short2", ["ba"], 0.5, task_id="t")]]
    with sharded(copy.deepcopy(base), cfg) as fsdp:
        prepared = fsdp.prepare(groups)
        counts = [micro_batch_count(s, cfg.micro_batch_tokens) for s in balance(prepared.active, 2)]
        assert counts[0] != counts[1], counts  # the case under test: the short rank pads its passes
        one = single.prepare(groups)
        assert_same_step(single, one, fsdp, prepared)
        assert prepared.sums["masked"] == one.sums["masked"]  # the padding passes add nothing


def test_a_rank_with_no_samples_still_joins_the_step():
    seed_everything(0)
    base, _ = build_tiny(0)
    single = Trainer(copy.deepcopy(base), CFG, MODEL, lora=False)
    with sharded(copy.deepcopy(base)) as fsdp:
        batch = groups_for(base)
        one, prepared = single.prepare(batch), fsdp.prepare(batch)
        # One sample runs through the model (the others only count in the normaliser), fewer than ranks.
        one.active, prepared.active = one.active[:1], prepared.active[:1]
        assert [len(s) for s in balance(prepared.active, 2)] == [1, 0]
        assert_same_step(single, one, fsdp, prepared)


def test_a_state_that_does_not_fit_is_refused_before_any_rank_changes():
    seed_everything(0)
    base, _ = build_tiny(0)
    one = Trainer(copy.deepcopy(base), CFG, MODEL, lora=False)
    one.step(groups_for(base))
    state = one.state_dict()
    state["optimizer"]["state"][3]["exp_avg"] = torch.zeros(7, 7)
    with sharded(copy.deepcopy(base)) as fsdp:
        with pytest.raises(ValueError, match=r"3.exp_avg: saved shape \(7, 7\) does not fit"):
            fsdp.load_state_dict(state)
        assert fsdp.step_count == 0
        assert fsdp.step(groups_for(base))["train/updated"] == 1.0  # no rank was left inside a collective


def test_a_killed_rank_fails_the_step_with_its_name():
    seed_everything(0)
    base, _ = build_tiny(0)
    with sharded(copy.deepcopy(base)) as fsdp:
        fsdp.procs[0].kill()
        fsdp.procs[0].join()
        prepared = fsdp.prepare(groups_for(base))
        with pytest.raises(RankError, match="rank 1"):
            fsdp.backward(prepared)


def test_a_rank_killed_mid_step_fails_the_step_with_its_name_instead_of_hanging():
    seed_everything(0)
    base, _ = build_tiny(0)
    with sharded(copy.deepcopy(base)) as fsdp:
        killer = threading.Timer(KILL_AFTER_S, fsdp.procs[0].kill)
        killer.start()
        try:
            with pytest.raises(RankError, match="rank 1 of 'policy'"):
                for _ in range(MAX_STEPS_BEFORE_KILL):  # steps until the kill lands, most likely inside a collective
                    fsdp.step(groups_for(base))
        finally:
            killer.cancel()


def test_fsdp2_refuses_one_rank_and_lora():
    with pytest.raises(ValueError, match="world_size >= 2"):
        ShardedTrainer(build_tiny(0)[0], CFG, MC, ["cpu"])
    with pytest.raises(ValueError, match="world_size >= 2"):
        ModelConfig(name=MODEL, trainer={"world_size": 1, "sharding": "fsdp2"})
    lora = ModelConfig(name=MODEL, device="cpu", lora={"r": 4})
    with pytest.raises(ValueError, match="LoRA"):
        ShardedTrainer(build_tiny(0)[0], CFG, lora, ["cpu", "cpu"])


def test_a_nan_step_is_skipped_on_every_shard_not_called_a_disagreement():
    """One NaN element in rank 0's gradient shard, as an overflow would leave: the global norm is NaN on
    every rank, each skips the step, and their (nan, True, False) outcomes agree."""
    base, _ = build_tiny(0)
    with sharded(copy.deepcopy(base)) as fsdp:
        accumulate = fsdp.shard.accumulate

        def poisoned(*args):
            sums = accumulate(*args)
            with torch.no_grad():
                local = next(p.grad.to_local() for p in fsdp.shard.model.parameters()
                             if p.grad is not None and p.grad.to_local().numel() > 0)
                local.view(-1)[0] = float("nan")
            return sums
        fsdp.shard.accumulate = poisoned
        prepared = fsdp.prepare(groups_for(base))
        fsdp.backward(prepared)
        assert fsdp.apply(prepared) is False
        assert prepared.skipped and math.isnan(prepared.grad_norm)
        assert all(torch.equal(p, q) for p, q in zip(fsdp.policy.parameters(), base.parameters()))


def test_a_sharded_dcp_checkpoint_written_at_two_ranks_resumes_in_one_unsharded_trainer(tmp_path):
    """Each rank writes its own shards (torch.distributed.checkpoint): none holds the whole state; the
    checkpoint loads at another world size (one trainer, no process group) with the same weights and
    AdamW moments as the gathered single-trainer state, and back into 2 fresh fsdp2 ranks."""
    seed_everything(0)
    base, _ = build_tiny(0)
    path = str(tmp_path / "dcp")
    with sharded(copy.deepcopy(base)) as fsdp:
        prepared = fsdp.prepare(groups_for(base))
        fsdp.backward(prepared)
        assert fsdp.apply(prepared)
        fsdp.save_sharded(path)
        whole = fsdp.state_dict()
        weights = {n: p.detach().clone() for n, p in fsdp.policy.named_parameters()}
    one = Trainer(copy.deepcopy(base), CFG, MODEL, lora=False)
    sharded_checkpoint.load(one, path)
    for name, p in one.policy.named_parameters():
        torch.testing.assert_close(p, weights[name], rtol=0, atol=0, msg=name)
    moments = [s["exp_avg"] for s in one.optimizer.state_dict()["state"].values()]
    saved = [s["exp_avg"] for s in whole["optimizer"]["state"].values()]
    assert len(moments) == len(saved) > 0
    for got, want in zip(moments, saved):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with sharded(copy.deepcopy(base)) as again:
        again.load_sharded(path)
        for name, p in again.policy.named_parameters():
            torch.testing.assert_close(p, weights[name], rtol=0, atol=0, msg=name)


def test_activation_checkpointing_per_decoder_layer_gives_the_same_step():
    """Each layer's activations recomputed in the backward (FSDP2 with transformers' non-reentrant
    checkpointing): the same gradient and step as one trainer keeping them (the file's tolerances)."""
    seed_everything(0)
    base, _ = build_tiny(0)
    single = Trainer(copy.deepcopy(base), CFG, MODEL, lora=False)
    mc = MC.model_copy(update={"trainer": MC.trainer.model_copy(update={"activation_checkpointing": True})})
    fsdp = ShardedTrainer(copy.deepcopy(base), CFG, mc, ["cpu", "cpu"])
    try:
        assert fsdp.shard.model.is_gradient_checkpointing
        batch = groups_for(base)
        assert_same_step(single, single.prepare(batch), fsdp, fsdp.prepare(batch))
    finally:
        fsdp.close()


def test_fsdp2_ranks_built_on_meta_from_the_config_alone_give_the_same_first_step(tmp_path):
    """The model's folder holds its config and no weights: every rank builds it on the meta device,
    shards it and allocates only its shards, filled from rank 0's module (before, each rank loaded the
    whole model from disk, and here could not start). The first step is one trainer's."""
    seed_everything(0)
    base, _ = build_tiny(KL_SEED)
    base.config.save_pretrained(tmp_path)  # config.json alone
    cfg = CFG.model_copy(update={"kl_coef": 0.1})  # the KL reference is built empty and filled too
    single = Trainer(copy.deepcopy(base), cfg, MODEL, lora=False)
    fsdp = ShardedTrainer(copy.deepcopy(base), cfg, ModelConfig(name=MODEL, device="cpu", source=str(tmp_path)),
                          ["cpu", "cpu"])
    try:
        batch = groups_for(base)
        assert_same_step(single, single.prepare(batch), fsdp, fsdp.prepare(batch))
    finally:
        fsdp.close()
