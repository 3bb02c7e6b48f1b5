"""A group's prompt held once in training (`trainer.share_prompt`): tokens and backward time, off against on.

The step shape of `bench/vs_trl.py`: SmolLM2-135M-Instruct, 2 groups of 8 one-call episodes on the
addition task's chat prompts (46 tokens each), completions of 4..24 tokens (random ids of random
lengths: the cost of a forward and backward pass does not depend on which tokens they are),
rewards alternating 0/1 so every episode has a nonzero advantage and runs through the model.
The two arms alternate in one process, `--repeats` times each, and the median counts.

    .venv/bin/python bench/share_prompt.py [--repeats 4] [--threads 2]

It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # bench/addition.py, the task of vs_trl.py

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import addition  # noqa: E402
from core.config import TrainerConfig  # noqa: E402
from core.models import smollm2_folder  # noqa: E402
from core.records import Call, Episode  # noqa: E402
from core.train.trainer import Trainer  # noqa: E402

GROUPS, GROUP_SIZE = 2, 8


def groups(tok, rng: random.Random) -> list[list[Episode]]:
    out = []
    for g, task in enumerate(addition.tasks("train", GROUPS)):
        prompt = tok.apply_chat_template([{"role": "user", "content": addition.question(task)}],
                                         add_generation_prompt=True, return_dict=False)
        group = []
        for e in range(GROUP_SIZE):
            completion = [rng.randrange(100, 40000) for _ in range(rng.randint(4, addition.MAX_TOKENS))]
            call = Call(model="policy", version=0, prompt_ids=list(prompt), completion_ids=completion,
                        completion_logprobs=[-3.0] * len(completion))
            group.append(Episode(id=f"g{g}-e{e}", sandbox="addition", task_id=task["id"], group_size=GROUP_SIZE,
                                 state="finished", opened_at=0.0, lease_expires_at=60.0, calls=[call],
                                 reward={"policy": float(e % 2)}))
        out.append(group)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    batch = groups(tok, random.Random(0))
    seconds: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, float] = {}
    for _ in range(args.repeats):
        for share in (False, True):
            trainer = Trainer(model, TrainerConfig(lr=1e-5, share_prompt=share), "policy", lora=False)
            prepared = trainer.prepare(batch)
            t0 = time.perf_counter()
            trainer.backward(prepared)  # forward + backward; no optimizer step, so both arms see the same weights
            seconds[share].append(time.perf_counter() - t0)
            trainer.discard()
            tokens[share] = prepared.sums["tokens"]
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"{'share_prompt':>12} {'tokens':>7} {'backward s (median)':>20}")
    print(f"{'off':>12} {tokens[False]:>7.0f} {off:>20.2f}")
    print(f"{'on':>12} {tokens[True]:>7.0f} {on:>20.2f}")
    print(f"share_prompt: token_ratio={tokens[False] / tokens[True]:.2f} time_ratio={off / on:.2f}")


if __name__ == "__main__":
    main()
