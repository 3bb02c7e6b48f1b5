"""Every engine implements the whole `Engine` protocol, and the run and gateway call nothing beyond it.

Engines subclass the protocol: the methods only a set of replicas needs (`sleep_during_step`,
`wake_after_step`, `status`)
are no-ops there, so the run and the server ask any engine for them instead of checking its type."""

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
from core.engine.replicas import ReplicaEngine
from core.engine.worker import WorkerEngine
from core.models import build_tiny
from core.ray.driver import RemoteEngine

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_METHODS = {n: f for n, f in vars(Engine).items() if inspect.isfunction(f) and not n.startswith("_")}
PROTOCOL_ATTRS = set(Engine.__annotations__)
# What an engine of one process inherits as a no-op; every other protocol method each engine writes itself.
DEFAULTED = {"sleep_during_step", "wake_after_step", "status", "stream_syncs"}


def _signature(fn) -> tuple[bool, list[str]]:
    return inspect.iscoroutinefunction(fn), list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("cls", [HFEngine, NullEngine, ReplicaEngine, RemoteEngine])
def test_each_engine_class_implements_every_protocol_method_with_its_signature(cls):
    assert {"generate", "pause", "pause_blocking", "hold", "resume", "swap_weights", "close"} <= set(PROTOCOL_METHODS)
    assert DEFAULTED <= set(PROTOCOL_METHODS)
    assert Engine in cls.__mro__  # so it has the defaults
    for name, proto in PROTOCOL_METHODS.items():
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}()"
        assert name in DEFAULTED or impl is not proto, f"{cls.__name__} inherits {name}() from the protocol"
        assert _signature(impl) == _signature(proto), f"{cls.__name__}.{name} differs from Engine.{name}"


def test_the_set_of_replicas_writes_what_the_protocol_defaults():
    for name in DEFAULTED:
        assert getattr(ReplicaEngine, name) is not PROTOCOL_METHODS[name], name


def test_an_engine_of_one_process_has_nothing_to_sleep_no_replicas_and_no_failure():
    model, tok = build_tiny()
    for engine in (HFEngine(model, tok, EngineConfig(), 64), NullEngine(tok, 64)):
        try:
            assert engine.sleep_during_step() == 0 and engine.wake_after_step() is None and engine.status() == []
            assert engine.failure is None and engine.last_sync_s == 0.0
        finally:
            engine.close()


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
    paths = [p for p in sorted((ROOT / "core").rglob("*.py")) if "engine" not in p.relative_to(ROOT / "core").parts]
    assert {"loop.py", "gateway.py", "server.py", "rollout_metrics.py", "watchdog.py"} <= {p.name for p in paths}
    for path in paths:  # the run, the gateway, the server, the watchdog, Ray's actors (not the engines themselves)
        used = set(re.findall(r"(?<!cfg)(?<!core)\.engine\.([a-z_]+)\b", path.read_text()))  # not `cfg.engine.<field>`, `core.engine.<module>`
        assert used <= declared, f"{path.name} uses {sorted(used - declared)} of an engine, not in the Engine protocol"
