"""How much of an RL-sized AdamW update a bf16 model keeps: bf16 weights stepped in place against
the trainer's fp32 master weights (`core.train.master`), with fp32 weights as the reference.

One real gradient of SmolLM2-135M-Instruct on the step shape of `bench/vs_trl.py` (2 groups of 8
one-call episodes of the addition task, fp32 forward and backward through `Trainer.backward`), then
`--steps` AdamW steps with that gradient at each learning rate, in three arms from the same weights:
fp32 stepped in place, bf16 stepped in place, and bf16 stepped through fp32 master copies. It prints
the fraction of the model's weights that changed after one step and after all of them, and how much
of the fp32 arm's update (its norm) the model's weights received.

    .venv/bin/python bench/bf16_update.py [--steps 10] [--lrs 1e-6 1e-5 1e-4] [--threads 2]

It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # bench/share_prompt.py builds the step's episodes

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from core.config import TrainerConfig  # noqa: E402
from core.models import smollm2_folder  # noqa: E402
from core.train.master import MasterWeights  # noqa: E402
from core.train.trainer import Trainer  # noqa: E402
from share_prompt import groups  # noqa: E402


def stepped(start: list[torch.Tensor], grads: list[torch.Tensor], arm: str, lr: float,
            steps: int) -> list[list[torch.Tensor]]:
    """The model's weights after each of `steps` AdamW steps with the same gradient, in one arm."""
    dtype = torch.float32 if arm == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in start]  # never a view of `start`
    master = MasterWeights(params) if arm == "bf16 + fp32 master" else None
    optimizer = torch.optim.AdamW(master.params if master else params, lr=lr, weight_decay=0.0)
    seen = []
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        if master:
            master.take_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master:
            master.write_back()
        seen.append([p.detach().float().clone() for p in params])
    return seen


def changed(now: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    return sum(int((a != b).sum()) for a, b in zip(now, start)) / sum(b.numel() for b in start)


def norm_of_change(now: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(now, start))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = Trainer(model, TrainerConfig(lr=1e-5), "policy", lora=False)
    trainer.backward(trainer.prepare(groups(AutoTokenizer.from_pretrained(folder), random.Random(0))))
    grads = [p.grad.detach().clone() for p in model.parameters()]
    # Every arm starts from the bf16-rounded weights, so "changed" compares like with like.
    start = [p.detach().to(torch.bfloat16).float() for p in model.parameters()]
    del trainer, model
    print(f"{'lr':>7} {'arm':<20} {'changed after 1':>15} {f'after {args.steps}':>9} {'update kept':>11}")
    for lr in args.lrs:
        reference = stepped(start, grads, "fp32", lr, args.steps)[-1]
        full = norm_of_change(reference, start)
        for arm in ("fp32", "bf16 in place", "bf16 + fp32 master"):
            seen = stepped(start, grads, arm, lr, args.steps)
            print(f"{lr:>7.0e} {arm:<20} {changed(seen[0], start):>15.4f} {changed(seen[-1], start):>9.4f} "
                  f"{norm_of_change(seen[-1], start) / full:>11.3f}")
    print("changed = fraction of the model's weights that differ from the start; update kept = norm of the "
          "model's change over the fp32 arm's, after all steps")


if __name__ == "__main__":
    main()
