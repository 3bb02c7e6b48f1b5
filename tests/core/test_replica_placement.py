"""`swarm run --dry-run` for one model on many devices: trainer ranks and replicas placed, checked, sized."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from core.engine.devices import model_devices
from core.config_io import ConfigError, load_config
from core.run.cli import app
from core.train.memory import choose_sharding, footprint, replica_use
from core.run.plan import describe, plan


def test_dry_run_prints_the_ranks_and_replicas_with_their_devices_and_memory(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"models": [{"device": "cpu", "replicas": 2, "trainer": {"world_size": 2}}]}))
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "trainer x2 (gloo data-parallel, sharding replicate (auto))" in result.output
    assert "2 hf replicas (split)" in result.output and "2 processes here" in result.output
    assert "devices cpu,cpu" in result.output and "weights synced after each step" in result.output


@pytest.mark.parametrize("layout, replicas", [("split", ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]),
                                              ("colocated", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])])
def test_layout_puts_replicas_beside_or_on_the_trainer_ranks_gpus(layout, replicas):
    mc = load_config({"models": [{"device": "cuda", "replicas": 4, "layout": layout,
                                  "trainer": {"world_size": 4}}]}).models[0]
    assert model_devices(mc, 8) == (["cuda:0", "cuda:1", "cuda:2", "cuda:3"], replicas)


def test_a_cpu_model_keeps_every_rank_and_replica_on_cpu_whatever_the_gpus():
    mc = load_config({"models": [{"device": "cpu", "replicas": 3, "trainer": {"world_size": 2}}]}).models[0]
    assert model_devices(mc, 8) == (["cpu", "cpu"], ["cpu", "cpu", "cpu"])


@pytest.mark.parametrize("model, match", [
    ({"device": "cuda", "replicas": 2}, "this machine has 0 GPU"),  # a local plan on a machine without them
    ({"device": "cpu", "replicas": 2, "trainable": False, "trainer": {"world_size": 2}}, "does not train"),
])
def test_a_placement_that_cannot_work_is_refused_naming_the_key(model, match):
    with pytest.raises(ConfigError, match=match):
        plan(load_config({"models": [model]}))


def test_trainer_ranks_on_ray_gpus_need_that_many_gpus_in_the_model_actor():
    cfg = load_config({"placement": {"kind": "ray"},
                       "models": [{"device": "cuda", "replicas": 2, "trainer": {"world_size": 4}, "ray": {"num_gpus": 1}}]})
    with pytest.raises(ConfigError, match=r"models.0.ray.num_gpus: 4 trainer ranks"):
        plan(cfg)


def test_lists_of_devices_must_match_the_counts():
    with pytest.raises(ConfigError, match="replica_devices lists 1 devices for 2 replicas"):
        load_config({"models": [{"replicas": 2, "replica_devices": ["cpu"]}]})
    with pytest.raises(ConfigError, match="devices lists 3 devices for world_size 2"):
        load_config({"models": [{"trainer": {"world_size": 2, "devices": ["cpu"] * 3}}]})


def test_the_memory_arithmetic_of_a_bf16_full_fine_tune():
    # 2 B weights + 2 B grads + 4 B fp32 master + 8 B AdamW moments = 16 B a parameter.
    cfg = load_config({"models": [{"source": "smollm2-135m", "device": "cuda", "trainer": {"world_size": 4}}]})
    fp = footprint(cfg, cfg.models[0], on_gpu=True)
    assert fp.parameters == 134_515_008 and fp.weight_bytes == 2
    assert fp.rank_gb == pytest.approx(134_515_008 * 16 / 1e9)
    assert fp.fsdp_rank_gb == pytest.approx(fp.rank_gb / 4) and fp.replica_gb == pytest.approx(134_515_008 * 2 / 1e9)


def test_dry_run_prints_the_sharding_and_an_fsdp2_rank_holds_a_share_of_the_state(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"models": [{"source": "smollm2-135m", "device": "cpu",
                                                "trainer": {"world_size": 2, "sharding": "fsdp2"}}]}))
    result = CliRunner().invoke(app, ["run", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "trainer x2 (gloo data-parallel, sharding fsdp2)" in result.output
    # fp32 on CPU: 4 B weights + 4 B grads + 8 B AdamW = 16 B a parameter, half of it on each rank.
    half = 134_515_008 * 16 / 2 / 1e9
    weights = 134_515_008 * 4 / 1e9  # rank 0 also keeps the full fp32 weights engines read
    assert f"rank {half:.2f} GB (fsdp2; rank 0 + {weights:.2f} GB of full weights for engines; " \
           f"replicated {2 * half:.2f} GB)" in result.output
    auto = load_config({"models": [{"device": "cpu", "trainer": {"world_size": 2}}]})
    assert "sharding replicate (auto)" in describe(auto)  # CPU memory is not counted: auto replicates


def test_auto_shards_a_7b_full_fine_tune_that_one_80gb_gpu_cannot_hold():
    # Qwen2.5-7B in bf16 with fp32 master weights: 7.6e9 x 16 B = 122 GB a replicated rank.
    assert choose_sharding(7.6e9 * 16 / 1e9, [80.0] * 8) == "fsdp2"
    assert choose_sharding(134_515_008 * 16 / 1e9, [80.0] * 8) == "replicate"  # SmolLM2: 2.2 GB fits
    assert choose_sharding(122.0, [None, 80.0]) == "replicate"  # a device's memory unknown here: no guess
    assert choose_sharding(122.0, [141.0, 80.0]) == "fsdp2"  # the smallest device decides


@pytest.mark.parametrize("model, match", [
    ({"device": "cpu", "trainer": {"world_size": 1, "sharding": "fsdp2"}}, "needs world_size >= 2"),
    ({"device": "cpu", "lora": {"r": 8}, "trainer": {"world_size": 2, "sharding": "fsdp2"}},
     "models.0.trainer.sharding: fsdp2 shards a full fine-tune"),
    ({"device": "cpu", "trainer": {"world_size": 2, "sharding": "fsdp2", "offload": True}},
     "fsdp2's shards are not offloaded"),
])
def test_fsdp2_that_cannot_work_is_refused_naming_the_key(model, match):
    with pytest.raises(ConfigError, match=match):
        plan(load_config({"models": [model]}))


QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}  # 7.6e9 parameters
GPU_GB = 80.0


@pytest.fixture
def two_80gb_gpus(monkeypatch):
    """Plan for a machine with two 80 GB GPUs, from this one (nothing is allocated: the plan is arithmetic)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("core.run.plan.device_memory_gb", lambda d: GPU_GB if d.startswith("cuda") else None)


def colocated_7b(tmp_path, offload: bool):
    """Qwen2.5-7B's shape, a bf16 full fine-tune with bf16 AdamW moments (no master copies: 8 B a
    parameter, 61 GB a rank), 2 replicated ranks and 2 vLLM replicas sharing their GPUs."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    return load_config({"engine": {"kind": "vllm", "gpu_memory_utilization": 0.4},
                        "trainer": {"master_weights": False},
                        "models": [{"source": str(tmp_path), "device": "cuda", "dtype": "bfloat16",
                                    "replicas": 2, "layout": "colocated",
                                    "trainer": {"world_size": 2, "sharding": "replicate", "offload": offload}}]})


def test_a_7b_colocated_layout_that_does_not_fit_80gb_is_refused_saying_offload_would(tmp_path, two_80gb_gpus):
    # Rollout: the rank's 61 GB + vLLM's 0.4 x 80 = 32 GB = 93 GB; the replica process keeps no second copy.
    with pytest.raises(ConfigError, match=r"cuda:0 would hold 9[0-9]\.\d GB \(9[0-9]\.\d GB during rollout.*"
                                          r"but has 80\.0 GB; "
                                          r"with models\.0\.trainer\.offload: true the fullest GPU would hold 6\d\.\d GB"):
        plan(colocated_7b(tmp_path, offload=False))


def test_a_vllm_replica_process_counts_no_second_copy_of_the_weights_and_a_ray_replica_does():
    fp = footprint(load_config({"models": [{"device": "cuda", "dtype": "bfloat16"}]}),
                   load_config({"models": [{"device": "cuda", "dtype": "bfloat16"}]}).models[0], on_gpu=True)
    assert replica_use(fp, "vllm", 0.4, 80.0) == (32.0, 0.0)  # vLLM's share awake; asleep, its weights in host memory
    assert replica_use(fp, "vllm", 0.4, 80.0, module_copy=True) == (32.0 + fp.replica_gb, fp.replica_gb)


def test_a_7b_colocated_layout_fits_80gb_once_the_trainer_offloads_during_rollout(tmp_path, two_80gb_gpus):
    # Rollout: vLLM's 32 GB; the step: the rank's 61 GB beside the sleeping replica (nothing on the GPU).
    text = describe(colocated_7b(tmp_path, offload=True))
    assert "2 vllm replicas (colocated)" in text


def test_dry_run_prints_each_process_s_devices_as_it_sees_them(tmp_path, two_80gb_gpus):
    text = describe(colocated_7b(tmp_path, offload=True))
    assert "rank 0: this process, rank 1: CUDA_VISIBLE_DEVICES=1 (cuda:0 inside)" in text
    assert "replica 0: CUDA_VISIBLE_DEVICES=0 (cuda:0 inside), replica 1: CUDA_VISIBLE_DEVICES=1 (cuda:0 inside)" in text
