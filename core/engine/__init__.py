"""The engine contract: token ids in, sampled token ids and their logprobs out.

An engine knows nothing of chat, episodes or HTTP. It generates from prompt ids, reports the weight
version that generated, and can be paused and drained so that a trainer may change its weights.
Implementations: `hf` (transformers, CPU default, dynamic batching) and `instant` (the null engine,
for gateway benchmarks). A vLLM engine (the `gpu` extra) is planned behind the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded completion text
    seed: int | None = None  # a seeded request samples the same tokens every time, batched or not


@dataclass
class Generation:
    token_ids: list[int]  # every sampled id, the EOS or the token that completed a stop string included
    logprobs: list[float]  # log p(token) under the temperature-1 policy: what the trainer optimises
    finish_reason: FinishReason
    version: int  # weight version that produced every token of this generation
    stop_string: str | None = None  # the stop string that ended it, if any
    timings: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    version: int
    max_context: int  # prompt + completion tokens the model accepts

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: Callable[[int], None] | None = None
    ) -> Generation:
        """Sample a completion; `on_token` (if given) sees each id as it is sampled, on the caller's loop."""

    async def pause(self) -> None:
        """Stop admitting new generations and wait until in-flight ones finish."""

    def resume(self, new_version: int | None = None) -> None:
        """Admit generations again, optionally announcing that the weights changed."""

    def close(self) -> None: ...


def make_engine(kind: str, model, tokenizer, cfg, max_context: int) -> Engine:
    if kind == "hf":
        from core.engine.hf import HFEngine

        return HFEngine(model, tokenizer, cfg, max_context)
    if kind == "instant":
        from core.engine.null import NullEngine

        return NullEngine(tokenizer, max_context)
    raise ValueError(f"unknown engine kind {kind!r}")
