"""Continuous batching against its anchors: the same 16 chats as one static batch, one by one, and at once.

Runs `smollm2-135m` behind a real server in this process. Three arms generate for the same 16
prompts (rendered by the server's own chat template), sampled at temperature 1:

- `static`: Hugging Face `generate` over all 16 prompts in one left-padded batch, no server: the
  anchor for what batching the same work can reach on this machine;
- `sequential`: the 16 chats one after another through the HTTP server and `openai.AsyncOpenAI`;
- `concurrent`: all 16 at once through the same server, which batches them continuously.

Tokens count what each chat generated (up to and including its EOS), never padding. The ratios are
concurrent / sequential (the batching speed-up) and concurrent / static (target ≥ 0.9).

With `--engine vllm` (run from the vLLM venv, `make test-vllm` builds it), the same chats are then
served by a second server on the vLLM engine (the served arms asked for, as `vllm-sequential` and
`vllm-concurrent`), and the table
adds vllm-concurrent / concurrent: vLLM against the hf engine, measured in the same invocation.

    .venv/bin/python bench/batching.py [--model smollm2-135m] [--chats 16] [--max-tokens 64]
                                       [--arms static,sequential,concurrent] [--engine vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402
import torch  # noqa: E402

from core.config_io import load_config  # noqa: E402
from core.serve.server import Policy, Server  # noqa: E402

ARMS = ("static", "sequential", "concurrent")
VLLM_ARMS = ("vllm-sequential", "vllm-concurrent")  # the served arms again, on `engine.kind: vllm`


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short story about the number {i}."}]


async def chat(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> int:
    r = await client.chat.completions.create(
        model="policy", messages=messages(i), max_tokens=max_tokens, temperature=1.0, seed=i,
    )
    return r.usage.completion_tokens


async def sequential(client: openai.AsyncOpenAI, chats: int, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = 0
    for i in range(chats):
        tokens += await chat(client, i, max_tokens)
    return tokens, time.perf_counter() - t0


async def concurrent(client: openai.AsyncOpenAI, chats: int, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(chat(client, i, max_tokens) for i in range(chats))))
    return tokens, time.perf_counter() - t0


@torch.inference_mode()
def static(policy: Policy, chats: int, max_tokens: int) -> tuple[int, float]:
    """One `model.generate` call over every prompt, left-padded, sampling at temperature 1."""
    prompts = [policy.renderer.render(messages(i), None).prompt_ids for i in range(chats)]
    tok = policy.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((chats, width), pad, dtype=torch.long)
    mask = torch.zeros((chats, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    torch.manual_seed(0)
    t0 = time.perf_counter()
    out = policy.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=True,
                                temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad)
    elapsed = time.perf_counter() - t0
    eos = set(policy.engine.eos_ids) if hasattr(policy.engine, "eos_ids") else {tok.eos_token_id}
    tokens = 0
    for row in out[:, width:].tolist():
        ends = [k for k, t in enumerate(row) if t in eos]
        tokens += ends[0] + 1 if ends else len(row)
    return tokens, elapsed


async def served_arms(url: str, arms: list[str], chats: int, max_tokens: int) -> dict[str, tuple[int, float]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", timeout=3600)
    await chat(client, 0, 4)  # warm-up
    results = {}
    if "sequential" in arms:
        results["sequential"] = await sequential(client, chats, max_tokens)
    if "concurrent" in arms:
        results["concurrent"] = await concurrent(client, chats, max_tokens)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                    help="vllm: also serve the chats from a vLLM engine and compare (needs vLLM installed)")
    ap.add_argument("--batch-window-ms", type=float, default=None, help="engine.batch_window_ms (default: the config's)")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {ARMS}")
    overrides = [f"models=[{{name: policy, source: {args.model}}}]", "server.port=0", f"engine.max_batch={max(args.chats, 1)}"]
    if args.batch_window_ms is not None:
        overrides.append(f"engine.batch_window_ms={args.batch_window_ms}")
    cfg = load_config(overrides=overrides)
    server = Server(cfg)
    url = server.start()
    engine = server.policies["policy"].engine
    results: dict[str, tuple[int, float]] = {}
    try:
        if "static" in arms:
            static(server.policies["policy"], 2, 4)  # warm-up
            results["static"] = static(server.policies["policy"], args.chats, args.max_tokens)
        results.update(asyncio.run(served_arms(url, arms, args.chats, args.max_tokens)))
    finally:
        server.stop()
    if args.engine == "vllm":  # after the hf server stopped: the two never compete for the cores
        vllm_server = Server(load_config(overrides=[*overrides, "engine.kind=vllm"]))
        vllm_url = vllm_server.start()
        try:
            served = asyncio.run(served_arms(vllm_url, arms, args.chats, args.max_tokens))
        finally:
            vllm_server.stop()
        results.update({f"vllm-{arm}": value for arm, value in served.items()})
    print(f"model {args.model}, {args.chats} chats, max_tokens {args.max_tokens}, "
          f"torch threads {torch.get_num_threads()}, "
          f"batch window {cfg.engine.batch_window_ms} ms")
    if hasattr(engine, "stats"):  # over the whole run, warm-ups included: fewer prefills means requests shared them
        print(f"hf engine: {engine.stats['batches']} prefill passes, at most {engine.stats['max_rows']} rows at once")
    print(f"{'arm':>12} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    rate = {}
    for arm in ARMS + VLLM_ARMS:
        if arm in results:
            tokens, seconds = results[arm]
            rate[arm] = tokens / seconds
            print(f"{arm:>12} {tokens:>7} {seconds:>8.1f} {rate[arm]:>9.1f}")
    if "concurrent" in rate and "sequential" in rate:
        print(f"speed-up over sequential {rate['concurrent'] / rate['sequential']:.2f}x")
    if "concurrent" in rate and "static" in rate:
        print(f"concurrent / static {rate['concurrent'] / rate['static']:.2f}x (target >= 0.9)")
    if "vllm-concurrent" in rate and "concurrent" in rate:
        print(f"vllm-concurrent / concurrent (vLLM against hf) {rate['vllm-concurrent'] / rate['concurrent']:.2f}x")


if __name__ == "__main__":
    main()
