"""What repeatable sampling costs, and whether runs repeat with it: the hf engine's decode tokens/s with
`engine.repeatable_sampling` off and on side by side, then two pairs of same-seed `swarm run`s.

Engine arms: B concurrent requests of `--tokens` tokens at temperature 1 (EOS ignored, so every row
runs to the end) on one engine; "off" draws every row's uniform from the run's one stream in a
single call, "on" gives each request its own seed from (run seed, key) and each row its own
generator (one draw a row a step). The arms alternate, `--repeats` times each, on the same weights
(SmolLM2-135M), after a warm-up; the figure is generated
tokens over the wall time from submission to the last row done, the median of the repeats.

Draws: what repeatable sampling adds to a decode step, alone: the hf engine drawing B rows' uniforms
(`HFEngine._uniforms`) from the run's one stream (one call) against one generator per row (B calls),
`--draw-steps` times each, alternating, median of 5 rounds in microseconds a step. Set beside a decode
step's forward pass (hundreds of ms for SmolLM2 at B = 16 on this CPU) it is the whole difference in
the hf engine; the end-to-end arms above measure it with the forward pass, and take long on a busy host.

Runs: `swarm run configs/tiny.yaml` with 16 episodes in flight, `trainer.max_staleness=0` and
`--steps` steps, twice with the same seed with repeatable sampling on, and twice with it off (each
pair side by side); `core.run.parting.first_parting` names the first step whose rewards part.

vLLM's cost (a seeded request leaves vLLM's batched sampler for a per-row loop) needs a GPU: measure
it with the same switch on `engine.kind=vllm` where one is lent (docs/benchmarks.md says whether it was).

    .venv/bin/python bench/repeatable_sampling.py [--tokens 32] [--repeats 3] [--no-engine] [--no-runs]

It measures and prints; it asserts nothing. The last line:
`repeatable_sampling: draw_us_b16=<off>/<on> draw_us_b32=<off>/<on> hf_ratio_b16=<on/off> hf_ratio_b32=<on/off>
parting_on=<step|none> parting_off=<step|none>` (one line; `skipped` for what was not run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from mlflow import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import EngineConfig
from core.engine import SamplingParams
from core.engine.hf import HFEngine, _Row
from core.models import smollm2_folder
from core.run.parting import first_parting

ROOT = Path(__file__).resolve().parents[1]
ROWS = (16, 32)


def load_model():
    """SmolLM2-135M: a real vocabulary (49k tokens), so the per-row draws are measured against real
    forward passes, not a 2-layer toy's."""
    folder = smollm2_folder()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)


def tokens_per_s(model, tok, rows: int, tokens: int, repeatable: bool) -> float:
    engine = HFEngine(model, tok, EngineConfig(max_batch=rows, repeatable_sampling=repeatable), max_context=2048)
    engine.eos_ids = set()  # every row decodes all its tokens, whatever it samples
    prompts = [tok(f"Request {i}: write a short story about the sea.", add_special_tokens=False)["input_ids"]
               for i in range(rows)]

    async def batch(n: int) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(ids, SamplingParams(max_tokens=n, temperature=1.0,
                                                                  key=f"bench/task/{i}/0/0"))
                               for i, ids in enumerate(prompts)))
        return time.perf_counter() - start

    try:
        asyncio.run(batch(2))  # warm-up
        return rows * tokens / asyncio.run(batch(tokens))
    finally:
        engine.close()


def draw_us(model, tok, rows: int, steps: int, repeatable: bool) -> float:
    """Microseconds a decode step spends drawing `rows` uniforms: per-row generators or the shared stream."""
    engine = HFEngine(model, tok, EngineConfig(max_batch=rows, repeatable_sampling=repeatable), max_context=2048)
    try:
        batch = [_Row(req=None, generator=torch.Generator().manual_seed(i) if repeatable else None, position=0,
                      version=0) for i in range(rows)]
        start = time.perf_counter()
        for _ in range(steps):
            engine._uniforms(batch)
        return (time.perf_counter() - start) / steps * 1e6
    finally:
        engine.close()


def run_pair(folder: Path, repeatable: bool, steps: int) -> tuple[int | None, str]:
    """Two same-seed runs side by side; (the first step whose rewards part, or None; a note)."""
    procs, ids = [], []
    for name in ("a", "b"):
        out = folder / f"{'on' if repeatable else 'off'}-{name}"
        out.mkdir(parents=True)
        ids.append(out / "run_id")
        sets = {"trainer.steps": steps, "trainer.seed": 0, "trainer.max_staleness": 0,
                "engine.repeatable_sampling": str(repeatable).lower(), "trainer.checkpoint_dir": out / "ckpt",
                "telemetry.experiment": "repeatable-bench"}
        args = [sys.executable, "-m", "core.run.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--quiet",
                "--run-id-file", str(ids[-1])]
        for key, value in sets.items():
            args += ["--set", f"{key}={value}"]
        procs.append(subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(out / "log", "w")))
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a run exited {p.returncode}: see {folder}")
    parting = first_parting(MlflowClient(), ids[0].read_text(), ids[1].read_text())
    return (None, "agree at every step") if parting is None else \
        (parting.step, f"{parting.metric} {parting.a} vs {parting.b}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--draw-steps", type=int, default=2000)
    ap.add_argument("--no-engine", action="store_true", help="skip the end-to-end engine arms")
    ap.add_argument("--no-runs", action="store_true", help="skip the same-seed run pairs")
    args = ap.parse_args()

    model, tok = load_model()
    print(f"model smollm2-135m, {args.tokens} tokens a row, {args.repeats} repeats, torch threads {torch.get_num_threads()}")
    draws = {}
    print(f"{'rows':>4} {'off us/step':>12} {'on us/step':>11}   (drawing the uniforms alone)")
    for rows in ROWS:
        got: dict[bool, list[float]] = {False: [], True: []}
        for i in range(5):
            for repeatable in ((False, True) if i % 2 == 0 else (True, False)):
                got[repeatable].append(draw_us(model, tok, rows, args.draw_steps, repeatable))
        draws[rows] = statistics.median(got[False]), statistics.median(got[True])
        print(f"{rows:>4} {draws[rows][0]:>12.1f} {draws[rows][1]:>11.1f}")

    ratios = {rows: "skipped" for rows in ROWS}
    if not args.no_engine:
        print(f"{'rows':>4} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7}")
        for rows in ROWS:
            got = {False: [], True: []}
            for i in range(args.repeats):
                for repeatable in ((False, True) if i % 2 == 0 else (True, False)):
                    got[repeatable].append(tokens_per_s(model, tok, rows, args.tokens, repeatable))
            off, on = statistics.median(got[False]), statistics.median(got[True])
            ratios[rows] = f"{on / off:.3f}"
            print(f"{rows:>4} {off:>10.1f} {on:>10.1f} {on / off:>7.3f}")

    parting = {True: "skipped", False: "skipped"}
    if not args.no_runs:
        with tempfile.TemporaryDirectory(prefix="repeatable-") as tmp:
            os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
            MlflowClient().search_experiments()  # create the store before two processes migrate it at once
            for repeatable in (True, False):
                step, note = run_pair(Path(tmp), repeatable, args.steps)
                parting[repeatable] = "none" if step is None else str(step)
                print(f"same seed twice, repeatable sampling {'on' if repeatable else 'off'}: "
                      f"first parting step {parting[repeatable]} ({note})")
    print(f"repeatable_sampling: draw_us_b16={draws[16][0]:.1f}/{draws[16][1]:.1f} "
          f"draw_us_b32={draws[32][0]:.1f}/{draws[32][1]:.1f} hf_ratio_b16={ratios[16]} hf_ratio_b32={ratios[32]} "
          f"parting_on={parting[True]} parting_off={parting[False]}")


if __name__ == "__main__":
    main()
