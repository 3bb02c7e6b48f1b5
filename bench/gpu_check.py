"""The GPU check: the hf engine's decode rate, the trainer's step time and peak memory, and a 1.5B model's MFU, on the lent GPU image as it is.

That image has torch, transformers, peft and numpy, no package index, and at most 64 MiB travels
with a command, so nothing here loads weights, MLflow, FastAPI or vLLM: models are random-
initialised in real shapes (decoding and training cost do not depend on the weights' values), and
pydantic/PyYAML come as carried wheels (`bench/gpu_check.sh` installs them). Three parts:

- engine: `core.engine.hf.HFEngine` on a SmolLM2-135M-shaped model, B = 1, 8, 32 concurrent
  requests of `--decode-tokens` tokens, with and without top_p 0.9 -> generated tokens/s.
- trainer: `core.train.trainer.Trainer` in bf16 with master weights over tree batches (merge tree,
  shared prompts; FlexAttention on CUDA), one step at 1k, 2k and 4k tokens while the engine keeps
  decoding on the same module (the overlap of `max_staleness: 1`) -> step seconds and peak GiB.
- mfu: one trainer step on a Qwen2-1.5B-shaped model, bf16, 4k tokens -> 6·N·T FLOPs / (time · peak).

    python bench/gpu_check.py [--device cuda] [--small]     (--small: toy shapes, for a CPU dry run)

It measures and prints one table per part and a last line:
`gpu_check: decode_tok_s_b32=<x> train_step_s=<y> mfu=<z> peak_gib=<w>`. vLLM is not on the image:
its figure waits until it can be carried, and the check says so instead of failing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from core.config import EngineConfig, TrainerConfig  # noqa: E402
from core.engine import SamplingParams  # noqa: E402
from core.engine.hf import HFEngine  # noqa: E402
from core.models import byte_tokenizer  # noqa: E402
from core.records import Call, Episode  # noqa: E402
from core.models import prepare_policy  # noqa: E402
from core.train.trainer import Trainer  # noqa: E402

# Dense bf16 peak of the GPUs this is lent on (NVIDIA's data sheets, without sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, max_position_embeddings=8192, tie_word_embeddings=True)


def model_of(cls, shape: dict, device: str, dtype: torch.dtype, attention: str = "sdpa") -> torch.nn.Module:
    config_cls = LlamaConfig if cls is LlamaForCausalLM else Qwen2Config
    torch.manual_seed(0)
    return cls(config_cls(**shape, attn_implementation=attention)).to(device=device, dtype=dtype).eval()


def decode(model, tok, device: str, tokens: int) -> list[tuple[int, bool, float]]:
    engine = HFEngine(model, tok, EngineConfig(max_batch=32), max_context=4096, seed=0)
    rows = []
    try:
        for batch in (1, 8, 32):
            for top_p in (1.0, 0.9):
                async def go() -> int:
                    params = SamplingParams(max_tokens=tokens, temperature=1.0, top_p=top_p)
                    gens = await asyncio.gather(*[engine.generate(list(range(1, 33)), params) for _ in range(batch)])
                    return sum(len(g.token_ids) for g in gens)
                asyncio.run(go())  # warm-up: kernels, allocator
                _sync(device)
                started = time.perf_counter()
                made = asyncio.run(go())
                _sync(device)
                rows.append((batch, top_p < 1, made / (time.perf_counter() - started)))
    finally:
        engine.close()
    return rows


def tree_groups(vocab: int, tokens: int, group: int = 4) -> list[list[Episode]]:
    """One group of `group` two-turn episodes (a shared prompt, a retry each), ~`tokens` tokens in all."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab, (tokens // 4,), generator=g).tolist()
    each = max(8, (tokens - len(prompt)) // (2 * group))
    episodes = []
    for k in range(group):
        calls = [Call(model="policy", version=0, prompt_ids=prompt,
                      completion_ids=(c := torch.randint(1, vocab, (each,), generator=g).tolist()),
                      completion_logprobs=[-2.0] * each, temperature=1.0) for _ in range(2)]
        episodes.append(Episode(id=f"e{k}", sandbox="bench", task_id="t", group_size=group, state="finished",
                                opened_at=0.0, lease_expires_at=60.0, calls=calls, reward={"policy": float(k % 2)}))
        del c
    return [episodes]


def train_step(model, vocab: int, device: str, tokens: int, overlap_engine: HFEngine | None) -> tuple[float, float]:
    trainer = Trainer(prepare_policy(model, None), TrainerConfig(lr=1e-5, merge="tree", share_prompt=True,
                                                                 micro_batch_tokens=tokens, master_weights=True),
                      "policy", lora=False)
    groups = tree_groups(vocab, tokens)
    trainer.step(groups)  # warm-up (FlexAttention compiles on first use)
    stop = threading.Event()
    decoding = threading.Thread(target=_keep_decoding, args=(overlap_engine, stop), daemon=True)
    if overlap_engine is not None:
        decoding.start()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    started = time.perf_counter()
    trainer.step(groups)
    _sync(device)
    took = time.perf_counter() - started
    stop.set()
    if overlap_engine is not None:
        decoding.join(30)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return took, peak


def _keep_decoding(engine: HFEngine, stop: threading.Event) -> None:
    async def go():
        while not stop.is_set():
            await engine.generate(list(range(1, 17)), SamplingParams(max_tokens=16))
    asyncio.run(go())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy shapes: a dry run of the whole check on a CPU")
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    tok = byte_tokenizer()
    small = TOY if args.small else SMOLLM2
    sizes = (256, 512) if args.small else (1024, 2048, 4096)

    model = model_of(LlamaForCausalLM, small, device, dtype)
    rows = decode(model, tok, device, 16 if args.small else args.decode_tokens)
    print(f"{'batch':>5} {'top_p':>6} {'tokens/s':>10}")
    for batch, top_p, rate in rows:
        print(f"{batch:>5} {'0.9' if top_p else '1.0':>6} {rate:>10.0f}")
    b32 = next(rate for batch, top_p, rate in rows if batch == 32 and not top_p)

    flex = "flex_attention" if device == "cuda" else "sdpa"
    trained = model_of(LlamaForCausalLM, small, device, dtype, flex)
    engine = HFEngine(trained, tok, EngineConfig(max_batch=8), max_context=4096, seed=0)
    print(f"{'tokens':>6} {'step s':>7} {'peak GiB':>9}   (bf16 + master weights, tree batches, engine decoding beside)")
    try:
        steps = {n: train_step(trained, small["vocab_size"], device, n, engine) for n in sizes}
    finally:
        engine.close()
    for n, (took, peak) in steps.items():
        print(f"{n:>6} {took:>7.2f} {peak:>9.2f}")

    big = model_of(Qwen2ForCausalLM, TOY if args.small else QWEN2_1_5B, device, dtype, flex)
    params = sum(p.numel() for p in big.parameters())
    tokens = sizes[-1]
    took, peak = train_step(big, (TOY if args.small else QWEN2_1_5B)["vocab_size"], device, tokens, None)
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    mfu = 6 * params * tokens / took / peak_flops if peak_flops else float("nan")
    print(f"mfu: {params / 1e9:.2f}B parameters, {tokens} tokens, step {took:.2f} s, peak {peak:.2f} GiB, "
          f"MFU {mfu:.3f} (6·N·T against {peak_flops or 'an unknown'} FLOP/s)")
    print("vllm: not on this image; its figure waits until vLLM can be carried or is installed there")
    train_s, train_peak = steps[sizes[-1]]
    print(f"gpu_check: decode_tok_s_b32={b32:.0f} train_step_s={train_s:.2f} mfu={mfu:.3f} peak_gib={train_peak:.2f}")


if __name__ == "__main__":
    main()
