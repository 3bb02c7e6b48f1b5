"""GPU placement config: `models[].device` and the dtype that follows from it (issue 11)."""

from __future__ import annotations

import pytest
import torch

from core import models
from core.config import ModelConfig
from core.config_io import ConfigError, load_config


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_names_are_accepted(device):
    assert load_config(overrides=[f"models=[{{source: tiny, device: '{device}'}}]"]).models[0].device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "mps"])
def test_an_unknown_device_is_an_error_that_names_the_key(device):
    with pytest.raises(ConfigError, match=r"models\.0\.device"):
        load_config(overrides=[f"models=[{{source: tiny, device: '{device}'}}]"])


def test_auto_places_the_model_on_the_gpu_only_when_one_is_visible():
    model, _ = models.load(ModelConfig(source="tiny"))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(model.parameters()).device.type == expected


@pytest.mark.parametrize(("device", "dtype"), [("cpu", torch.float32), ("cuda", torch.bfloat16), ("cuda:0", torch.bfloat16)])
def test_dtype_defaults_to_bf16_on_gpu_and_fp32_on_cpu(device, dtype):
    assert models.resolve_dtype(ModelConfig(device=device), torch.device(device)) == dtype


def test_a_configured_dtype_wins_over_the_default():
    model, _ = models.load(ModelConfig(source="tiny", device="cpu", dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        models.load(ModelConfig(source="tiny", device="cuda"))
