"""An engine that answers instantly with a fixed one-token reply, to measure everything around it.

It exists for gateway benchmarks (added latency, calls/s) and for tests of the HTTP surface that must
not depend on a model's speed. It never trains and its logprobs are all zero.
"""

from __future__ import annotations

from collections.abc import Callable

from core.engine import Engine, EngineLoad, Generation, SamplingParams, scoring_temperature, scoring_top_p


class NullEngine(Engine):
    def __init__(self, tokenizer, max_context: int):
        self.version = 0
        self.max_context = max_context
        self._reply = tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids: list[int], params: SamplingParams, on_token=None) -> Generation:
        ids = self._reply[: max(1, params.max_tokens)]
        for t in ids if on_token is not None else ():
            on_token(t)
        finish = "stop" if ids[-1] == self._reply[-1] else "length"
        return Generation(token_ids=list(ids), logprobs=[0.0] * len(ids), finish_reason=finish, version=self.version,
                          temperature=scoring_temperature(params.temperature),
                          top_p=scoring_top_p(params.temperature, params.top_p))

    async def pause(self) -> None:
        return None

    def pause_blocking(self) -> None:
        return None

    def hold(self) -> None:
        return None

    def swap_weights(self, apply: Callable[[], bool]) -> bool:
        changed = apply()
        self.version += int(changed)
        return changed

    def resume(self, new_version: int | None = None) -> None:
        if new_version is not None:
            self.version = new_version

    def load(self) -> EngineLoad:
        return EngineLoad(queued=0, active=0, admitting=True, oldest_s=None)  # it answers at once

    def close(self) -> None:
        return None
