"""The engine contract: token ids in, sampled token ids and their logprobs out.

An engine knows nothing of chat, episodes or HTTP. It generates from prompt ids, reports the weight
version that generated, and can be paused and drained so that a trainer may change its weights.
Implementations: `hf` (transformers, CPU default, dynamic batching), `instant` (the null engine,
for gateway benchmarks) and `vllm` (vLLM 0.32, the `gpu` extra: paged attention, weight sync
from the trainer). `core.engine.factory.make_engine` builds one by `engine.kind`; the worker-thread
plumbing the `hf` and `vllm` engines share is `core.engine.worker`.

The bottom layer: it may import only the foundation (`core.config`, `core.models`), never train/,
episodes/, serve/ or anything above; it must import with torch and transformers alone present.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # below GREEDY_BELOW (0 included) means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded completion text
    seed: int | None = None  # a seeded request samples the same tokens every time, batched or not
    # Which draw this is, stable across runs (the gateway's: episode, call and choice). Under
    # `engine.repeatable_sampling` an unseeded request's seed derives from (run seed, key), not from
    # the order requests arrive in (`core.engine.worker.derive_seed`); ignored otherwise.
    key: str | None = None


# Temperatures below this sample greedily. Dividing logits by a smaller one overflows float32 (a
# logit of 10 over 1e-39 is inf, and softmax of inf is NaN), and at 1e-4 a logit gap of 0.01 is
# already e^100 apart: the sample is the argmax either way, so greedy is what such a request means.
GREEDY_BELOW = 1e-4


class GenerationError(RuntimeError):
    """One request could not be generated (its logits were NaN, its sampling failed); the others go on."""


def is_greedy(temperature: float) -> bool:
    """Whether a request at this temperature decodes greedily (0, or below `GREEDY_BELOW`)."""
    return temperature < GREEDY_BELOW


def scoring_temperature(temperature: float) -> float:
    """The temperature at which a call's logprobs are computed, and at which the trainer scores them.

    Sampling at T > 0 draws from softmax(logits / T), so that is the behaviour policy. Greedy
    decoding (T = 0, or below `GREEDY_BELOW`) is a point mass with no useful logprob; its tokens are scored at T = 1.
    """
    return 1.0 if is_greedy(temperature) else temperature


def scoring_top_p(temperature: float, top_p: float) -> float:
    """The nucleus a call's logprobs are computed within, and the trainer scores them within.

    A greedy call takes the argmax whatever top_p says (the top token is always in the nucleus), so
    top_p is dropped for it, as vLLM drops it: its logprobs are of the whole distribution at T = 1,
    and it records top_p 1 so the trainer scores the same (not the nucleus, which would differ)."""
    return 1.0 if is_greedy(temperature) else top_p


@dataclass
class Generation:
    token_ids: list[int]  # every sampled id, the EOS or the token that completed a stop string included
    # log p(token) under softmax(logits / scoring_temperature(T)): the distribution that sampled it
    # (before any top_p truncation; see docs/architecture.md for how the PPO ratio treats top_p < 1)
    logprobs: list[float]
    finish_reason: FinishReason
    # Oldest weight version among its tokens: the version that prefilled it. Weights may be swapped
    # between two decode steps (overlapped training), so later tokens can come from a newer version.
    version: int
    temperature: float = 1.0  # scoring_temperature of the request: the logprobs are of this distribution
    top_p: float = 1.0  # scoring_top_p of the request: the nucleus mass its logprobs are within (1 when greedy)
    stop_string: str | None = None  # the stop string that ended it, if any
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineLoad:
    """What an engine is doing right now: the hang watchdog's view (`core.run.watchdog`)."""

    queued: int  # requests waiting for a row
    active: int  # requests being decoded
    admitting: bool  # False while held or paused for a weight sync
    oldest_s: float | None  # age of the oldest request not yet answered; None when none is in flight


class Engine(Protocol):
    """What the gateway and the run loop ask of an engine. An engine class subclasses it, so that it has
    what only a set of replicas (`core.engine.replicas`) needs (`sleep_during_step`, `wake_after_step`,
    `status`, `failure`, `last_sync_s`) as the no-ops below; callers then never ask which engine they hold.

    `sleep_during_step` is not `WorkerEngine.sleep`: that one frees the memory of an engine whose module
    is its own (inside a replica process, at its replica set's request); an engine in the trainer's
    process shares the trainer's module and has nothing to give the step."""

    version: int
    max_context: int  # prompt + completion tokens the model accepts
    # What made the engine unable to serve for good (a replica that could not be brought back), for the
    # run to fail with; None while it serves.
    failure: BaseException | None = None
    last_sync_s: float = 0.0  # seconds the last weight sync to other processes took; 0 when they share the module

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: Callable[[int], None] | None = None
    ) -> Generation:
        """Sample a completion; `on_token` (if given) sees each id as it is sampled, on the caller's loop."""

    async def pause(self) -> None:
        """Stop admitting new generations and wait until in-flight ones finish."""

    def pause_blocking(self) -> None:
        """`pause` for a caller on a plain thread (the trainer)."""

    def hold(self) -> None:
        """Stop admitting new generations without waiting: rows already decoding go on."""

    def resume(self, new_version: int | None = None) -> None:
        """Admit generations again, optionally announcing that the weights changed."""

    def swap_weights(self, apply: Callable[[], bool]) -> bool:
        """Run `apply` (which may change the weights in place) between two forward passes; generation
        goes on around it. When `apply` returns True (weights changed) the version goes up by one.
        Returns what `apply` returned; raises what it raises, with the version unchanged."""

    def load(self) -> EngineLoad:
        """Queue, active requests, admission and the oldest request's age, for diagnostics."""

    def sleep_during_step(self) -> int:
        """During an on-policy step (after `pause_blocking`): give device memory the step needs back;
        returns how many processes went to sleep. None by default: an engine in the trainer's process
        shares its module and has nothing of its own to give."""
        return 0

    def wake_after_step(self) -> None:
        """After the step, before `resume`: take back what `sleep_during_step` gave. Nothing by default."""
        return None

    def stream_syncs(self, stream: Callable[[Callable[[dict[str, Any]], None]], None]) -> bool:
        """Take every later weight sync from `stream` (an FSDP2 trainer's `stream_weights`: the weights as
        shards made whole one at a time) instead of the trainer's module; returns whether it does, and
        so whether the trainer may stop keeping a whole module. Not by default: an engine in the
        trainer's process generates with that module."""
        return False

    def status(self) -> list[dict[str, Any]]:
        """Each replica's row (device, health, served version, load, restarts) for the server's status and
        the run's metrics; none by default: an engine of one process is not a set of replicas."""
        return []

    def close(self) -> None: ...
