"""Dynamic batching: generated tokens/s for 16 concurrent chats against the same 16 run one by one.

Runs `smollm2-135m` behind a real server in this process and talks to it with `openai.AsyncOpenAI`,
the way agents do. Both arms ask for the same prompts with the same seeds, so they generate the same
kind of work; the ratio of their token rates is the batching speed-up.

    .venv/bin/python bench/batching.py [--model smollm2-135m] [--chats 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402
import torch  # noqa: E402

from core.config import load_config  # noqa: E402
from core.server import Server  # noqa: E402


async def chat(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> int:
    r = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": f"Write a short story about the number {i}."}],
        max_tokens=max_tokens, temperature=1.0, seed=i,
    )
    return r.usage.completion_tokens


async def measure(url: str, chats: int, max_tokens: int) -> tuple[float, float, int, int]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", timeout=3600)
    await chat(client, 0, 4)  # warm-up
    t0 = time.perf_counter()
    seq_tokens = 0
    for i in range(chats):
        seq_tokens += await chat(client, i, max_tokens)
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    par_tokens = sum(await asyncio.gather(*(chat(client, i, max_tokens) for i in range(chats))))
    t_par = time.perf_counter() - t0
    return seq_tokens / t_seq, par_tokens / t_par, seq_tokens, par_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    cfg = load_config(overrides=[f"models=[{{name: policy, source: {args.model}}}]", "server.port=0"])
    server = Server(cfg)
    url = server.start()
    try:
        seq, par, n_seq, n_par = asyncio.run(measure(url, args.chats, args.max_tokens))
    finally:
        server.stop()
    print(f"model {args.model}, {args.chats} chats, max_tokens {args.max_tokens}, torch threads {torch.get_num_threads()}")
    print(f"{'arm':>12} {'tokens':>7} {'tokens/s':>9}")
    print(f"{'sequential':>12} {n_seq:>7} {seq:>9.1f}")
    print(f"{'concurrent':>12} {n_par:>7} {par:>9.1f}")
    print(f"speed-up {par / seq:.2f}x")


if __name__ == "__main__":
    main()
