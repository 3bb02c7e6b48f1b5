"""Decode tokens/s of the hf engine at B = 1, 8 and 32 rows, with and without top_p, before and after its GPU-scale hot paths.

Before: the engine as of commit `BEFORE` (host-side sampling: the [B, V] logits copied to the CPU,
a full-vocabulary sort per top_p row; the KV cache and mask concatenated every step). After: this
tree (batched sampling on the model's device, `core.engine.batch_cache`). The before tree is
extracted with `git archive` into a temporary folder and imported in a subprocess whose PYTHONPATH
is that folder, so both arms run the same script (`--worker`) on the same SmolLM2-135M weights.
For each (B, top_p) the two arms run back to back, their order alternating, each in a fresh process.

Each arm decodes B concurrent requests of `--tokens` tokens at temperature 1 (EOS ignored, so every
row runs to the end); the figure is generated tokens over the wall time from submission to the
last row done, after a warm-up request. Prefill is in it, once per distinct prompt (B prompts).

    .venv/bin/python bench/engine_decode.py [--tokens 24]

It measures and prints; it asserts nothing. The last line:
`engine_decode: b32_speedup=<x> topp_speedup=<y>` (after / before tokens/s at B = 32, without and with top_p).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "dddeef1"  # the last engine before batched device sampling and the preallocated cache
ROWS = (1, 8, 32)
TOP_PS = (1.0, 0.9)


def worker(folder: str, rows: int, top_p: float, tokens: int) -> dict:
    """Run in the arm's tree: its `core` is whichever one PYTHONPATH names."""
    import asyncio
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.config import EngineConfig
    from core.engine import SamplingParams
    from core.engine.hf import HFEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    engine = HFEngine(model, tok, EngineConfig(max_batch=max(rows, 1)), max_context=2048)
    engine.eos_ids = set()  # every row decodes all its tokens, whatever it samples
    prompts = [tok(f"Request {i}: write a short story about the sea.", add_special_tokens=False)["input_ids"]
               for i in range(rows)]
    params = SamplingParams(max_tokens=tokens, temperature=1.0, top_p=top_p)

    async def batch(n_tokens: int) -> tuple[int, float]:
        p = SamplingParams(max_tokens=n_tokens, temperature=1.0, top_p=top_p)
        start = time.perf_counter()
        done = await asyncio.gather(*(engine.generate(ids, p) for ids in prompts))
        return sum(len(g.token_ids) for g in done), time.perf_counter() - start

    try:
        asyncio.run(batch(2))  # warm-up: first-call allocations and kernels
        generated, seconds = asyncio.run(batch(params.max_tokens))
    finally:
        engine.close()
    return {"tokens": generated, "seconds": seconds, "tok_s": generated / seconds}


def _run_arm(tree: Path, folder: str, rows: int, top_p: float, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", folder, str(rows), str(top_p),
                          str(tokens)], env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--worker", nargs=4, metavar=("FOLDER", "ROWS", "TOP_P", "TOKENS"))
    args = parser.parse_args()
    if args.worker:
        folder, rows, top_p, tokens = args.worker
        print(json.dumps(worker(folder, int(rows), float(top_p), int(tokens))))
        return
    sys.path.insert(0, str(ROOT))
    from core.models import smollm2_folder

    folder = str(smollm2_folder())
    results: dict[tuple[str, int, float], dict] = {}
    with tempfile.TemporaryDirectory() as before_tree:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", before_tree], input=archive.stdout, check=True)
        trees = {"before": Path(before_tree), "after": ROOT}
        for i, (rows, top_p) in enumerate((r, p) for r in ROWS for p in TOP_PS):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for arm in order:
                results[arm, rows, top_p] = _run_arm(trees[arm], folder, rows, top_p, args.tokens)
    print(f"{'B':>3} {'top_p':>5} {'before tok/s':>13} {'after tok/s':>12} {'speedup':>8}")
    for rows in ROWS:
        for top_p in TOP_PS:
            before, after = results["before", rows, top_p]["tok_s"], results["after", rows, top_p]["tok_s"]
            print(f"{rows:>3} {top_p:>5} {before:>13.1f} {after:>12.1f} {after / before:>8.2f}")
    b32 = results["after", 32, 1.0]["tok_s"] / results["before", 32, 1.0]["tok_s"]
    topp = results["after", 32, 0.9]["tok_s"] / results["before", 32, 0.9]["tok_s"]
    print(f"engine_decode: b32_speedup={b32:.2f} topp_speedup={topp:.2f}")


if __name__ == "__main__":
    main()
