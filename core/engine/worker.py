"""The part every in-process engine shares: one worker thread, a request queue, pause and weight swaps.

`WorkerEngine` is the skeleton of the `hf` and `vllm` engines. Callers queue requests (`generate`)
and weight changes (`swap_weights`) from any thread or event loop; one worker thread, written by the
subclass (`_run`), owns the model, takes requests, steps the batch and calls `_run_swaps` between two
forward passes, so a weight change never lands mid-pass. Admission (`hold`, `pause`, `resume`) is
three events the worker reads. The run's sampler (`_rng`, seeded from `trainer.seed`) lives here too:
the hf engine draws unseeded rows' tokens from it, and a checkpoint saves its state (`sampler_state`)
so a resumed run continues the stream instead of replaying it. A drained engine can `sleep` (give
back the device memory it holds, each engine's `_release`) and `wake`, both run on the worker. Under `engine.repeatable_sampling`
every request gets its own seed (`request_seed`): derived from (run seed, the request's `key`) when
the gateway names the draw, so a run repeats whatever order concurrent requests arrive in. This
module deliberately holds no batching, sampling or model code: that is each engine's own.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.engine import Engine, EngineLoad, Generation, SamplingParams

IDLE_POLL_S = 0.05  # how often an idle worker (or a trainer waiting on a swap) looks up to notice close()
SEED_BITS = 63  # derived seeds fit a signed int64: torch, numpy and vLLM all take them


def derive_seed(run_seed: int, key: str) -> int:
    """A request's sampling seed from the run's seed and the draw's stable name (`SamplingParams.key`):
    the same pair gives the same seed in every process and run (a hash, not Python's salted `hash`)."""
    digest = hashlib.blake2b(f"{run_seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


@dataclass
class Request:
    """One queued generation, resolved on the caller's event loop."""

    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    on_token: Callable[[int], None] | None = None  # called on the request's event loop, for streaming
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class Swap:
    """A weight change the worker runs between two forward passes, for a waiting trainer thread."""

    apply: Callable[[], bool]  # True when it changed the weights
    # The version served after it (a replica catching up with the trainer), not one more; None: one more.
    version: int | None = None
    # Not a weight change but work only the worker may do (sleep, wake): no hook, the version stays.
    task: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    changed: bool = False
    error: BaseException | None = None


def stop_ids(model, tokenizer) -> set[int]:
    """Token ids that end a completion: the model's generation config EOS (one or a list) and the tokenizer's."""
    gen_cfg = getattr(model, "generation_config", None)
    eos = gen_cfg.eos_token_id if gen_cfg else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    ids.add(tokenizer.eos_token_id)
    return {int(e) for e in ids if e is not None}


def resolve(req: Request, result: Generation | None = None, exc: BaseException | None = None) -> None:
    """Settle a request's future from the worker thread, on the request's own loop (once)."""

    def settle() -> None:
        if req.future.done():
            return
        if exc is not None:
            req.future.set_exception(exc)
        else:
            req.future.set_result(result)

    req.loop.call_soon_threadsafe(settle)


class WorkerEngine(Engine, ABC):
    """The `Engine` API over a worker thread; subclasses write `_run` and may extend the hooks."""

    thread_name = "engine"
    close_join_s = 5.0  # how long close() waits for the worker's current step

    def __init__(self, model: torch.nn.Module, tokenizer, cfg, max_context: int, seed: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.max_context = max_context
        self.seed = seed  # the run's `trainer.seed`
        # Every request gets its own seed (`request_seed`); off, only requests that name one do, and the
        # rest draw from the run's one stream (hf) or vLLM's own (its batched fast path).
        self.repeatable = cfg.repeatable_sampling
        self.version = 0
        self._queue: queue.Queue[Request | None] = queue.Queue()  # None only wakes an idle worker
        self._swaps: queue.Queue[Swap] = queue.Queue()
        self._admitting = threading.Event()
        self._admitting.set()
        # Admission (the check that the engine admits, then joining requests to the batch) runs under
        # this lock, and hold/pause clear `_admitting` under it: once hold() returns, nothing is
        # admitted until resume, even a request the worker was already waiting for.
        self._admit_lock = threading.Lock()
        self._held_back: deque[Request | None] = deque()  # dequeued while held: admitted first after resume
        self._drained = threading.Event()
        self._closed = threading.Event()
        self._asleep = False  # `sleep` released the engine's device memory; `wake` takes it back
        # Requests not yet answered (queued or decoding) -> when they were submitted: the watchdog's view.
        self._inflight: dict[int, float] = {}
        self._inflight_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._rng = torch.Generator().manual_seed(seed)  # only the worker thread draws from it

    def _start(self) -> None:
        """Start the worker; the subclass calls it last in its constructor, once its own state exists."""
        self._thread.start()

    # -- the run's sampler ----------------------------------------------------------------------
    def sampler_state(self) -> torch.Tensor:
        """The sampler's state, for a checkpoint (a copy; call it between steps, while generation is held)."""
        return self._rng.get_state().clone()

    def restore_sampler(self, state: torch.Tensor) -> None:
        """Continue the stream a checkpoint saved (`sampler_state`)."""
        self._rng.set_state(state)

    def request_seed(self, params: SamplingParams) -> int | None:
        """The seed a request samples with: its own; else, under repeatable sampling, one derived from
        (run seed, its key), or for a request without a key (no episode) the next of the run's stream;
        else None (it draws from the run's shared stream, in arrival order). Called on the worker."""
        if params.seed is not None:
            return params.seed
        if not self.repeatable:
            return None
        if params.key is not None:
            return derive_seed(self.seed, params.key)
        return int(torch.randint(0, 2**31 - 1, (1,), generator=self._rng))

    # -- public API ---------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Refuse a prompt before queueing it (a subclass may check more)."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a causal model needs at least one token of context")

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: Callable[[int], None] | None = None
    ) -> Generation:
        if self._closed.is_set():
            raise RuntimeError("engine is closed")
        self.check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = Request(list(prompt_ids), params, fut, loop, on_token)
        with self._inflight_lock:
            self._inflight[id(req)] = req.submitted
        self._queue.put(req)
        try:
            return await fut
        except asyncio.CancelledError:
            fut.cancel()  # a client that hung up frees its row at the worker's next step
            raise
        finally:
            with self._inflight_lock:
                del self._inflight[id(req)]

    def load(self) -> EngineLoad:
        with self._inflight_lock:
            inflight = list(self._inflight.values())
        queued = min(self._queue.qsize() + len(self._held_back), len(inflight))  # the queue may also hold wake-ups (None)
        oldest = time.perf_counter() - min(inflight) if inflight else None
        return EngineLoad(queued=queued, active=len(inflight) - queued, admitting=self._admitting.is_set(),
                          oldest_s=oldest)

    async def pause(self) -> None:
        self._drained.clear()
        self.hold()  # at once, before the await: nothing new is admitted from here
        await asyncio.to_thread(self._drained.wait)

    def pause_blocking(self) -> None:
        self._drained.clear()
        self.hold()
        self._drained.wait()

    def hold(self) -> None:
        """Admit nothing until `resume`; returns once an admission under way (if any) has finished."""
        with self._admit_lock:
            self._admitting.clear()

    def resume(self, new_version: int | None = None) -> None:
        self.wake()  # a run that slept the engine (`sleep`) and resumes it without waking it first
        if new_version is not None:
            self.version = new_version
        self._admitting.set()

    def swap_weights(self, apply: Callable[[], bool]) -> bool:
        return self._on_worker(Swap(apply))

    def replace_weights(self, load: Callable[[], None], version: int) -> int:
        """A replica's sync: `load()` another's weights between two forward passes, then serve `version`
        (the trainer's, not one more than now). The weights count as changed, so an engine with its own
        copy of them (vLLM) takes them in before its next step. Returns the version served."""
        self._on_worker(Swap(lambda: load() or True, version))
        return self.version

    # -- sleep: a drained engine gives its device memory back while a colocated trainer steps --------
    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> int:
        """Release what device memory the drained engine holds until `wake`; returns the bytes released
        (0 where there is nothing to gain, as on CPU). Only for an engine whose module is its own (a
        replica process): the engine must be paused (`pause_blocking`) and nothing is admitted asleep."""
        if self._admitting.is_set() or not self._drained.is_set():
            raise RuntimeError("sleep needs a drained engine: pause_blocking first")
        freed: list[int] = []
        self._on_worker(Swap(lambda: freed.append(self._release()) or False, task=True))
        self._asleep = True
        return freed[0]

    def wake(self) -> None:
        """Take the memory back (the weights the engine served before `sleep`); admission stays as it was."""
        if self._asleep:
            self._on_worker(Swap(lambda: self._reclaim() or False, task=True))
            self._asleep = False

    def _release(self) -> int:
        """On the worker: free device memory, return the bytes freed (each engine knows what it holds)."""
        return 0

    def _reclaim(self) -> None:
        """On the worker: take back what `_release` freed."""

    def _on_worker(self, swap: Swap) -> bool:
        if self._closed.is_set():
            raise RuntimeError("engine is closed")
        self._swaps.put(swap)
        self._queue.put(None)  # wake a worker blocked on an empty request queue
        while not swap.done.wait(IDLE_POLL_S):
            if not self._thread.is_alive():  # closed meanwhile: nothing generates, apply it here
                self._run_swaps()
        if swap.error is not None:
            raise swap.error
        return swap.changed

    def close(self) -> None:
        self._closed.set()
        self._admitting.set()
        self._thread.join(timeout=self.close_join_s)

    # -- worker ---------------------------------------------------------------------------------
    def _dequeue(self, timeout: float | None) -> Request | None:
        """The next request, held-back ones first; `timeout` None does not wait. Raises queue.Empty."""
        if self._held_back:
            return self._held_back.popleft()
        return self._queue.get_nowait() if timeout is None else self._queue.get(timeout=timeout)

    def _admitted(self, reqs: list[Request], admit: Callable[[list[Request]], None]) -> bool:
        """Run `admit(reqs)` if the engine admits now, under the admission lock; else keep `reqs` for
        after resume (in order, ahead of the queue). The worker calls it for every batch it dequeued."""
        with self._admit_lock:
            if not self._admitting.is_set():
                self._held_back.extendleft(reversed(reqs))
                return False
            admit(reqs)
            return True

    @abstractmethod
    def _run(self) -> None:
        """The worker thread's loop: admit, decode, retire (`core.engine.hf`, `core.engine.vllm`)."""

    def _after_swap(self, changed: bool) -> None:
        """Called on the worker after a swap's `apply`, before the version moves (vLLM syncs its copy)."""

    def _run_swaps(self) -> None:
        """Apply pending weight changes; only the worker runs forward passes, so none is mid-way."""
        while True:
            try:
                swap = self._swaps.get_nowait()
            except queue.Empty:
                return
            try:
                with torch.no_grad():
                    swap.changed = bool(swap.apply())
                if not swap.task:
                    self._after_swap(swap.changed)
                    if swap.changed:
                        self.version = self.version + 1 if swap.version is None else swap.version
            except BaseException as e:  # handed to the trainer thread, which logs it with its step
                swap.error = e
            swap.done.set()
