"""The transformers engine: continuous batching of concurrent requests on one HF causal LM.

One worker thread owns the model while generating. Requests queue up; at every decode step the
worker admits waiting requests (a batched prefill, left-padded), copies their KV cache into the
running batch's preallocated one (`core.engine.batch_cache`: capacities double, so a decode step
writes one column instead of concatenating the cache and mask), decodes one token for every active
row, and retires rows that finished. Sixteen agents
calling at once therefore share forward passes instead of running one after another.

Sampling is per row (temperature, top_p, stop strings, seed); stop strings are matched on the
incrementally decoded text (`core.engine.detokenize`), so one whose characters span tokens matches.
Logprobs are those of the tempered distribution the row sampled from (`scoring_temperature`,
within `scoring_top_p`'s nucleus), so the trainer can score the same policy. A seeded row (a
request's seed, or every request under `engine.repeatable_sampling`) draws from its own generator; the
others share the run's stream. Under repeatable sampling a row's logits do not depend on which rows
share its batch either, to the last bit: prompts are prefilled only beside prompts of their own length
(left padding beside a longer one changes the order of its attention's sums), a decode step attends
each row over its own columns only, and one of fewer rows than the linear layers need to be
batch-invariant runs padded to that many (`core.engine.batch_invariance`). A decode step reads the device once.
A request whose prefill or sampling fails (a NaN row of logits from a diverged model, say) gets its
own `GenerationError` and the rows already decoding go on; at most `max_batch` rows are active.
A temperature below `GREEDY_BELOW` decodes greedily, and a top_p so small that it rounds to zero
keeps the most likely token, so no sampling parameter can divide by zero. A trainer may change the weights between two decode steps
(`swap_weights`) or after draining (`pause`/`resume`). This is not a paged-attention server:
padding columns are kept until every row that needs them leaves, which is fine at CPU batch sizes.
The queue, admission events and weight-swap plumbing it shares with the vLLM engine are
`core.engine.worker.WorkerEngine`'s; this module is the batching and sampling.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from core.config import EngineConfig
from core.engine import Generation, GenerationError, is_greedy, scoring_temperature, scoring_top_p
from core.engine.batch_cache import BatchCache
from core.engine.batch_invariance import ROW_ATTENTION, invariant_rows
from core.engine.detokenize import IncrementalText, StopMatcher
from core.engine.sampling import sample_batch
from core.engine.worker import IDLE_POLL_S, Request, WorkerEngine, resolve, stop_ids
from core.models import attention_view

log = logging.getLogger(__name__)


@dataclass
class _Row:
    req: Request
    generator: torch.Generator | None
    position: int  # position id of the next token fed
    version: int  # weight version that prefilled it: the oldest behind any of its tokens
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: IncrementalText | None = None  # the completion's stable text, decoded as it grows (rows with stops)
    stops: StopMatcher | None = None
    finish: str | None = None
    stop_string: str | None = None
    error: BaseException | None = None  # set with finish: the row failed alone and is resolved with this


class HFEngine(WorkerEngine):
    thread_name = "hf-engine"

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: EngineConfig, max_context: int, seed: int = 0):
        super().__init__(model, tokenizer, cfg, max_context, seed)  # `self._rng`: the run's seeded sampler
        self.eos_ids = stop_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # The model's device (`models[].device`): the running batch's KV cache and mask live there;
        # ids and a prefill's mask are built on the CPU row by row, and only a forward pass's inputs move.
        self.device = next(model.parameters()).device
        # What decodes: the model, or under repeatable sampling a view of it (same weights) whose attention
        # is row by row, fed at least `decode_rows` rows (`core.engine.batch_invariance`); prefills run the
        # model itself (`_admit` groups them by prompt length).
        self.decoder = attention_view(model, ROW_ATTENTION) if self.repeatable else model
        self.decode_rows = invariant_rows(model, cfg.max_batch) if self.repeatable else 1
        self.stats = {"batches": 0, "max_rows": 0, "tokens": 0}
        self._start()

    # -- worker ---------------------------------------------------------------------------------
    def _run(self) -> None:
        rows: list[_Row] = []
        cache: BatchCache | None = None
        while not self._closed.is_set():
            self._run_swaps()
            try:
                if not self._admitting.is_set() and not rows:
                    self._drained.set()
                    self._admitting.wait(IDLE_POLL_S)
                    continue
                new = []  # bound before _take, so a failure below knows which requests it held
                new = self._take(block=not rows, room=self.cfg.max_batch - len(rows))
                if new:
                    def admit(reqs: list[Request]) -> None:
                        nonlocal rows, cache
                        rows, cache = self._admit(reqs, rows, cache)
                    if not self._admitted(new, admit):
                        new = []  # held back until resume; not this batch's to fail
                    self.stats["max_rows"] = max(self.stats["max_rows"], len(rows))
                if rows:
                    rows, cache = self._retire(rows, cache)
                if rows:
                    self._decode(rows, cache)
                    rows, cache = self._retire(rows, cache)
            except Exception as e:  # a broken decode step fails its rows, never the worker
                log.exception("engine batch failed")
                for req in [row.req for row in rows] + new:  # resolve() settles each at most once
                    resolve(req, exc=e)
                rows, cache = [], None
        self._run_swaps()  # a trainer waiting on a swap must not hang on a closed engine

    def _admit(self, reqs: list[Request], rows: list[_Row], cache: BatchCache | None):
        """Prefill `reqs`, sample their first tokens and join them to the running batch. A prefill or
        first sample that raises is retried one request at a time, so only the request that cannot be
        admitted fails; running rows are untouched (nothing of theirs changes before `_merge`). Under
        repeatable sampling the prompts of each length are admitted on their own (none is left-padded)."""
        lengths = {len(r.prompt_ids): None for r in reqs}
        if self.repeatable and len(lengths) > 1:
            for length in lengths:
                rows, cache = self._admit([r for r in reqs if len(r.prompt_ids) == length], rows, cache)
            return rows, cache
        try:
            new_rows, new_cache, new_mask, last_logits = self._prefill(reqs)
            self._sample(new_rows, last_logits)
        except Exception as e:
            if len(reqs) == 1:
                log.warning("admitting a %d-token prompt failed: %s: %s", len(reqs[0].prompt_ids), type(e).__name__, e)
                resolve(reqs[0], exc=e if isinstance(e, GenerationError) else
                        GenerationError(f"the request could not be admitted: {type(e).__name__}: {e}"))
                return rows, cache
            for r in reqs:
                rows, cache = self._admit([r], rows, cache)
            return rows, cache
        if cache is None:
            cache = BatchCache(max_rows=self.cfg.max_batch)
        cache.append_rows(new_cache, new_mask)
        return rows + new_rows, cache

    def _take(self, block: bool, room: int) -> list[Request]:
        if not self._admitting.is_set() or room <= 0:
            return []
        taken: list[Request] = []
        if block:
            try:
                first = self._dequeue(IDLE_POLL_S)
            except queue.Empty:
                return []
            if first is None:  # a wake-up for a pending swap
                return []
            taken.append(first)
            deadline = time.perf_counter() + self.cfg.batch_window_ms / 1000
            while len(taken) < room and (left := deadline - time.perf_counter()) > 0:
                try:
                    taken.append(self._dequeue(left))
                except queue.Empty:
                    break
        while len(taken) < room:
            try:
                taken.append(self._dequeue(None))
            except queue.Empty:
                break
        return [r for r in taken if r is not None and not r.future.cancelled()]

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request]) -> tuple[list[_Row], DynamicCache, torch.Tensor, torch.Tensor]:
        # A group's episodes open with the same prompt (GRPO: one task, `group_size` samples): each
        # distinct prompt is run once and its KV cache copied to every row that shares it. Prefill is
        # compute-bound, so this cuts it by the group size (bench/vs_trl.py: 1.7 s -> 0.2 s a step).
        distinct: dict[tuple[int, ...], int] = {}
        slots = [distinct.setdefault(tuple(r.prompt_ids), len(distinct)) for r in reqs]
        prompts = list(distinct)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), past_key_values=cache, use_cache=True)
        cache, last_logits = out.past_key_values, out.logits[:, -1, :]
        if len(prompts) < len(reqs):  # one row per request, in request order
            index = torch.tensor(slots, dtype=torch.long)
            mask, on_device = mask[index], index.to(self.device)  # the mask stays on the CPU, as built
            cache.batch_select_indices(on_device)
            last_logits = last_logits[on_device]
        rows = [
            _Row(req=r, generator=_generator(self.request_seed(r.params)), position=len(r.prompt_ids),
                 version=self.version)
            for r in reqs
        ]
        self.stats["batches"] += 1
        return rows, cache, mask, last_logits

    @torch.inference_mode()
    def _decode(self, rows: list[_Row], cache: BatchCache) -> None:
        padding = max(0, self.decode_rows - len(rows))
        ids = torch.tensor([[r.token_ids[-1]] for r in rows] + [[self.pad_id]] * padding, dtype=torch.long)
        positions = torch.tensor([[r.position] for r in rows] + [[0]] * padding, dtype=torch.long)
        out = self.decoder(input_ids=ids.to(self.device), attention_mask=cache.decode_mask(len(rows) + padding),
                         position_ids=positions.to(self.device), past_key_values=cache, use_cache=True)
        cache.advance(1)
        for r in rows:
            r.position += 1
        self._sample(rows, out.logits[: len(rows), -1, :])

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """One token for every row, sampled on the model's device in one batch (`core.engine.sampling`).
        A row whose logits are not usable (NaN) or whose draw fails is marked failed (`error`, retired
        with it at the next `_retire`); the other rows are sampled. Sampling parameters are host values
        and the draw is read back in one piece (`Sampled.to_host`): one device-to-host sync a step."""
        params = [r.req.params for r in rows]
        try:
            sampled = sample_batch(logits, [0.0 if is_greedy(p.temperature) else p.temperature for p in params],
                                   [p.top_p for p in params], self._uniforms(rows))
            drawn = sampled.to_host()  # the decode step's one device-to-host read
        except Exception as e:  # noqa: BLE001 - the batch's draw: its rows' callers get the reason
            for row in rows:
                row.finish, row.error = "error", GenerationError(f"sampling failed: {type(e).__name__}: {e}")
            return
        for row, (token, logprob, bad) in zip(rows, drawn):
            if bad:
                row.finish, row.error = "error", GenerationError(
                    "the model's logits for this request are not finite (NaN): its weights may have diverged")
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            self.stats["tokens"] += 1
            self._check_finish(row, token)
            if row.req.future.cancelled():
                row.finish = "length"
            elif row.req.on_token is not None:
                row.req.loop.call_soon_threadsafe(row.req.on_token, token)

    def _uniforms(self, rows: list[_Row]) -> torch.Tensor:
        """[B] each row's uniform: from its own generator when it has one (a seeded request, or every
        request under `engine.repeatable_sampling`: then a row's tokens do not depend on which rows
        share its batch), else the next of the run's stream, drawn for all such rows at once."""
        shared = iter(torch.rand(sum(r.generator is None for r in rows), generator=self._rng).split(1))
        return torch.cat([torch.rand(1, generator=r.generator) if r.generator is not None else next(shared)
                          for r in rows]) if rows else torch.empty(0)

    def _check_finish(self, row: _Row, token: int) -> None:
        p = row.req.params
        if token in self.eos_ids:
            row.finish = "stop"
            return
        if p.stop:
            # Matched on incrementally decoded text: a character split across tokens (a byte-level
            # tokenizer's '椀' is three tokens) only appears once its last byte has, and one token's
            # text can depend on the token before it, so decoding each token alone would miss both.
            if row.text is None:
                row.text = IncrementalText(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))
                row.stops = StopMatcher(p.stop)
            found = row.stops.feed(row.text.add(token))
            if found is not None:
                row.finish, row.stop_string = "stop", found
                return
        if len(row.token_ids) >= p.max_tokens or row.position + 1 >= self.max_context:
            row.finish = "length"

    def _retire(self, rows: list[_Row], cache: BatchCache):
        done = [r for r in rows if r.finish]
        if not done:
            return rows, cache
        for r in done:
            if r.error is not None:
                resolve(r.req, exc=r.error)
                continue
            gen = Generation(
                token_ids=r.token_ids,
                logprobs=r.logprobs,
                finish_reason=r.finish,  # type: ignore[arg-type]
                version=r.version,
                temperature=scoring_temperature(r.req.params.temperature),
                top_p=scoring_top_p(r.req.params.temperature, r.req.params.top_p),
                stop_string=r.stop_string,
                timings={"queue_to_done_s": time.perf_counter() - r.req.submitted},
            )
            resolve(r.req, result=gen)
        keep = [i for i, r in enumerate(rows) if not r.finish]
        if not keep:
            return [], None
        return [rows[i] for i in cache.keep_rows(keep)], cache


    def _release(self) -> int:
        """What a drained hf engine still holds: nothing of its own. The batch's KV cache went when the
        last row retired (there is no prefix cache), but on a GPU torch's caching allocator keeps those
        blocks reserved for this process; handing them back lets the colocated trainer (another
        process) use them. The weights stay: a replica's sync loads the next ones into them. On CPU
        freed memory goes back to the allocator at once: nothing to release."""
        if self.device.type != "cuda":
            return 0
        reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return max(0, reserved - torch.cuda.memory_reserved(self.device))


def _generator(seed: int | None) -> torch.Generator | None:
    return torch.Generator().manual_seed(seed) if seed is not None else None
