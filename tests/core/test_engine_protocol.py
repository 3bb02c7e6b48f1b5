"""Every engine implements the whole `Engine` protocol, and the run and gateway call nothing beyond it."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from core.config import EngineConfig
from core.engine import Engine
from core.engine.hf import HFEngine
from core.engine.null import NullEngine
from core.engine.worker import WorkerEngine
from core.models import build_tiny

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_METHODS = {n: f for n, f in vars(Engine).items() if inspect.isfunction(f) and not n.startswith("_")}
PROTOCOL_ATTRS = set(Engine.__annotations__)


def _signature(fn) -> tuple[bool, list[str]]:
    return inspect.iscoroutinefunction(fn), list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("cls", [HFEngine, NullEngine])
def test_each_engine_class_implements_every_protocol_method_with_its_signature(cls):
    assert {"generate", "pause", "pause_blocking", "hold", "resume", "swap_weights", "close"} <= set(PROTOCOL_METHODS)
    for name, proto in PROTOCOL_METHODS.items():
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}()"
        assert _signature(impl) == _signature(proto), f"{cls.__name__}.{name} differs from Engine.{name}"


def test_the_vllm_engine_implements_the_protocol_through_the_shared_worker():
    """vLLM is an optional extra: read its class from the source (its own venv imports it in tests/vllm)."""
    tree = ast.parse((ROOT / "core/engine/vllm.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VLLMEngine")
    assert [ast.unparse(b) for b in cls.bases] == ["WorkerEngine"]
    own = {f.name: f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name, proto in PROTOCOL_METHODS.items():
        if name in own:  # an override keeps the protocol's shape
            args = [a.arg for a in own[name].args.args]
            assert (isinstance(own[name], ast.AsyncFunctionDef), args) == _signature(proto), name
        else:
            assert _signature(getattr(WorkerEngine, name)) == _signature(proto), name


def test_engines_set_the_protocol_attributes():
    model, tok = build_tiny()
    for engine in (HFEngine(model, tok, EngineConfig(), 64), NullEngine(tok, 64)):
        try:
            for attr in PROTOCOL_ATTRS:
                assert hasattr(engine, attr), f"{type(engine).__name__} has no {attr}"
        finally:
            engine.close()


def test_the_run_and_the_gateway_call_only_protocol_methods_on_engines():
    declared = set(PROTOCOL_METHODS) | PROTOCOL_ATTRS
    for path in sorted((ROOT / "core").glob("*.py")):  # the run, the gateway, the server, the watchdog...
        used = set(re.findall(r"(?<!cfg)(?<!core)\.engine\.([a-z_]+)\b", path.read_text()))  # not `cfg.engine.<field>`, `core.engine.<module>`
        assert used <= declared, f"{path.name} uses {sorted(used - declared)} of an engine, not in the Engine protocol"
