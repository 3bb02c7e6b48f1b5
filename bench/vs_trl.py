"""swarmrl against TRL's `GRPOTrainer` on the same task and settings, back to back in one invocation.

Task (`bench/addition.py`): "What is A + B? Answer with just the number.", A, B in 1..50, reward 1
when the last integer equals the sum. Settings, both sides: SmolLM2-135M-Instruct, 2 prompts x 8
generations per step, <= 24 completion tokens, T = 1, constant lr 1e-5, beta 0 (no KL), epsilon 0.2,
grad clip 1.0, fp32, no gradient checkpointing, 12 steps; LoRA arms use r 16, alpha 32 on q_proj and
v_proj at lr 1e-4. swarmrl runs on-policy (`max_staleness: 0`) and async (`max_staleness: 1`), plus a
`dtype: bfloat16` arm. Each arm is its own process (peak RSS is per arm), on the same thread count.

It prints per (arm, seed): s/step (median of steps 2..N), completions/s (steps 2..N), train and rollout
time per step, steps with zero advantage, peak RSS, mean reward of the first and last 3 steps, the achieved
fraction of a compute limit built from the issue's measurements of this CPU, for swarmrl the mean gap
between the trainer's and the engine's logprobs of the same tokens (`train/behaviour_logp_diff`), and the
seconds and steps each took to reach a rolling 3-step mean reward of 0.5; then each run's reward by step;
then, over the seeds of each arm, the median (and range) of those seconds and steps, and the lines
`vs_trl_seeds: <arm> learning_per_s=<TRL's median seconds over ours> steps_ratio=<our median steps over
TRL's>` (issue 43), and `vs_trl: onpolicy_ratio=<x> async_ratio=<y>` (completions/s over TRL's, first seed).
Every seed of either side trains on the same tasks in the same order; the seed varies the samples (TRL's
`seed`, swarmrl's `trainer.seed` with `engine.repeatable_sampling`). A TRL seed repeats step for step; a
swarmrl seed repeats for some steps and then parts (continuous batching changes the logits' last bits:
docs/benchmarks.md, "swarmrl against TRL on a quiet host"), so read its seeds as draws.
TRL comes from the optional `bench` extra: `make bench-setup`.

    .venv/bin/python bench/vs_trl.py [--arms trl swarmrl-onpolicy ...] [--steps 12] [--seeds 0 1 2]
                                     [--stop-at-reward] [--threads 1] [--parallel 1] [--deadline-s SECONDS]

Arms run back to back by default. `--parallel N` runs N arms at once, so that on a shared machine
they see the same background load (each arm is still its own process with its own threads). Each
arm writes its measurements after every step; `--deadline-s` stops the arms still running at that
time and reports the steps they finished, marked as partial.

It measures and prints; it asserts nothing and writes only into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import addition  # noqa: E402  (bench/ is the script's folder, so the task imports by name in every arm)

PROMPTS, GENERATIONS = 2, 8
# Learning per second: seconds until the rolling 3-step mean reward reaches 0.5 (issue 23), TRL's over ours.
TARGET_REWARD, REWARD_WINDOW = 0.5, 3
LR_FULL, LR_LORA = 1e-5, 1e-4
LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}
# The issue's measurements of this CPU (2 cores): matmul throughput and memory bandwidth. The limit
# of a step is its FLOPs at that throughput (training 6 N per token, prefill 2 N per prompt token)
# plus one read of the weights per decode step.
FLOPS = {"float32": 183e9, "bfloat16": 405e9}
MEMORY_BYTES_PER_S = 33e9
ARMS = {  # name -> (side, dtype, lora, max_staleness)
    "trl": ("trl", "float32", False, 0),
    "swarmrl-onpolicy": ("swarmrl", "float32", False, 0),
    "swarmrl-async": ("swarmrl", "float32", False, 1),
    "trl-lora": ("trl", "float32", True, 0),
    "swarmrl-lora-onpolicy": ("swarmrl", "float32", True, 0),
    "swarmrl-lora-async": ("swarmrl", "float32", True, 1),
    "swarmrl-bf16": ("swarmrl", "bfloat16", False, 0),
    "swarmrl-filter": ("swarmrl", "float32", False, 0),
    "swarmrl-async-filter": ("swarmrl", "float32", False, 1),
}
# Trainer settings of an arm beyond the shared ones: dynamic sampling keeps tied groups out of the batch.
TRAINER_EXTRA = {"swarmrl-filter": {"dynamic_sampling": "filter"}, "swarmrl-async-filter": {"dynamic_sampling": "filter"}}


# The arms import their side inside (torch, TRL, the core): TRL is an optional extra, and the parent
# process only launches arms and prints, so it never loads either framework.
def run_trl(arm: str, steps: int, seed: int, out: Path, report) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from core.models import smollm2_folder

    _, dtype, lora, _ = ARMS[arm]
    rows = [{"prompt": [{"role": "user", "content": addition.question(t)}], "a": t["a"], "b": t["b"]}
            for t in addition.tasks("train", PROMPTS * steps)]
    zero_advantage: list[bool] = []

    def scored(completions, a, b, **kw) -> list[float]:
        rewards = addition.trl_reward(completions, a, b)
        groups = [rewards[i:i + GENERATIONS] for i in range(0, len(rewards), GENERATIONS)]
        zero_advantage.append(all(max(g) == min(g) for g in groups))
        return rewards

    scored.__name__ = "addition"
    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps, learning_rate=LR_LORA if lora else LR_FULL,
        lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=0.2, max_grad_norm=1.0, temperature=1.0,
        num_generations=GENERATIONS, per_device_train_batch_size=PROMPTS * GENERATIONS, gradient_accumulation_steps=1,
        max_completion_length=addition.MAX_TOKENS, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        model_init_kwargs={"dtype": getattr(torch, dtype)}, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=seed, shuffle_dataset=False, dataloader_num_workers=0,
    )
    peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"],
                      task_type="CAUSAL_LM") if lora else None
    trainer = GRPOTrainer(model=str(smollm2_folder()), reward_funcs=[scored], args=config,
                          train_dataset=Dataset.from_list(rows), peft_config=peft)
    rollout_s: list[float] = []
    generate = trainer._generate_and_score_completions  # timed, not changed: TRL's rollout for one step

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            rollout_s.append(time.perf_counter() - start)

    trainer._generate_and_score_completions = timed_generate
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    def collect() -> dict:
        logs = [h for h in trainer.state.log_history if "reward" in h]
        done = min(len(ends), len(logs))  # a step counts once its log (rewards, lengths) is written
        step_s = [b - a for a, b in zip([start] + ends, ends)][:done]
        return {"step_s": step_s, "rollout_s": rollout_s[:done], "train_s": [s - r for s, r in zip(step_s, rollout_s)],
                "rewards": [h["reward"] for h in logs][:done], "zero_advantage": zero_advantage[:done],
                "completion_tokens": [h.get("completions/mean_length", 0.0) * PROMPTS * GENERATIONS for h in logs][:done]}

    class Report(TrainerCallback):
        def on_log(self, args, state, control, **kw):  # after on_step_end: the step's rewards are logged
            if report(collect()):
                control.should_training_stop = True

    trainer.add_callback(StepClock())
    trainer.add_callback(Report())
    start = time.perf_counter()
    trainer.train()
    return collect()


def run_swarmrl(arm: str, steps: int, seed: int, out: Path, report) -> dict:
    from core.config_io import load_config
    from core.run.loop import CoreRun

    _, dtype, lora, staleness = ARMS[arm]
    model = {"name": "policy", "source": "smollm2-135m", "dtype": dtype, **({"lora": LORA} if lora else {})}
    cfg = load_config({
        "models": [model],
        # Repeatable sampling keys each request's seed by (seed, task, call): a seed's run repeats step
        # for step, as TRL's does (issue 43); the seeds vary the samples, never the tasks' order.
        "engine": {"max_batch": 32, "default_temperature": addition.TEMPERATURE, "repeatable_sampling": True},
        "server": {"port": 0},
        "trainer": {"steps": steps, "batch_groups": PROMPTS, "group_size": GENERATIONS, "lr": LR_LORA if lora else LR_FULL,
                    "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0, "grad_clip": 1.0, "advantage": "grpo",
                    "max_staleness": staleness, "seed": seed, "checkpoint_dir": str(out / "ckpt"), "keep_checkpoints": 1,
                    **TRAINER_EXTRA.get(arm, {})},
        # As many episodes in flight as admission control lets train (max_staleness + 1 steps), never more:
        # with more, the opens it holds back race for each step's room, so which tasks a step trains (and
        # a seed's rewards) would depend on timing. At exactly one step's worth on-policy, the client's next
        # two tasks are the next step's, as TRL's dataloader deals them. (Dynamic sampling's refill still
        # takes whichever held task's open reaches the room first. `trainer.oversample` would need room for
        # up to twice a step's groups in flight.)
        "clients": [{"agent": "addition", "concurrency": (staleness + 1) * PROMPTS * GENERATIONS}],
        "telemetry": {"tracking_uri": f"sqlite:///{out}/mlflow.db", "experiment": "vs-trl"},
    })
    # Clients run as their own processes (`clients[].isolate`, the default): they import the task by
    # name from this folder, as this process does.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
    core = CoreRun(cfg)
    ends, metrics = [], []

    def collect() -> dict:
        step_s = [b - a for a, b in zip([start] + ends, ends)]
        return {"step_s": step_s, "rollout_s": [m.get("time/rollout_s", float("nan")) for m in metrics],
                "train_s": [m.get("time/train_s", float("nan")) + m.get("time/sync_s", 0.0) for m in metrics],
                "rewards": [m["reward/mean"] for m in metrics],
                "zero_advantage": [m.get("train/updated", 1.0) == 0.0 for m in metrics],
                "completion_tokens": [m.get("train/trained_tokens", float("nan")) for m in metrics],
                "logp_diff": [m.get("train/behaviour_logp_diff", float("nan")) for m in metrics],
                "wasted_frac": metrics[-1].get("episodes/wasted_frac", float("nan")) if metrics else float("nan")}

    def on_step(step: int, m: dict) -> None:
        ends.append(time.perf_counter())
        metrics.append(dict(m))
        if report(collect()):
            core.stop.set()  # after this step: the arm reached the reward it is timed to

    core.server.start()
    start = time.perf_counter()
    try:
        core.start_clients()
        core.train(on_step=on_step)
    finally:
        core.stop_clients()
        core.server.stop()
    return collect()


def limit_s(dtype: str, params: int, prompt_tokens: int, completion_tokens: float) -> float:
    """The compute limit of one step at the issue's measured throughput of this CPU (see FLOPS)."""
    samples = PROMPTS * GENERATIONS
    flops = 6 * params * (samples * prompt_tokens + completion_tokens) + 2 * params * PROMPTS * prompt_tokens
    weight_bytes = params * (4 if dtype == "float32" else 2)
    return flops / FLOPS[dtype] + addition.MAX_TOKENS * weight_bytes / MEMORY_BYTES_PER_S


def model_size() -> tuple[int, int]:
    """(parameters of the base model, tokens of one rendered prompt) for the compute limit."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from core.models import smollm2_folder

    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.device("meta"):  # shapes only: no weights are read
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).parameters())
    text = tok.apply_chat_template([{"role": "user", "content": addition.question({"a": 23, "b": 41})}],
                                   add_generation_prompt=True, tokenize=False)
    return params, len(tok(text, add_special_tokens=False)["input_ids"])


def summary(arm: str, seed: int, r: dict) -> dict:
    # Step 1 pays for warm-up (first batches, allocator): steps 2..N are the steady state. An arm
    # stopped at the deadline after one step has only that one.
    later = slice(1, None) if len(r["step_s"]) > 1 else slice(None)
    s_step = statistics.median(r["step_s"][later])
    cps = PROMPTS * GENERATIONS * len(r["step_s"][later]) / sum(r["step_s"][later])
    tokens = statistics.mean(r["completion_tokens"][later])
    return {"arm": arm, "seed": seed, "s_step": s_step, "cps": cps, "train_s": statistics.median(r["train_s"][later]),
            "rollout_s": statistics.median(r["rollout_s"][later]), "zero_adv": sum(r["zero_advantage"]),
            "rss_gb": r["peak_rss_kb"] / 2 ** 20, "first3": statistics.mean(r["rewards"][:3]),
            "last3": statistics.mean(r["rewards"][-3:]),
            "limit": limit_s(ARMS[arm][1], r["params"], r["prompt_tokens"], tokens) / s_step,
            "wasted": r.get("wasted_frac", float("nan")), "steps": len(r["step_s"]), "partial": not r.get("complete"),
            "rewards": r["rewards"], "logp_diff": _finite_mean(r.get("logp_diff", [])),
            "to_reward_s": time_to_reward(r["rewards"], r["step_s"]), "to_reward_steps": steps_to_reward(r["rewards"])}


def steps_to_reward(rewards: list[float], target: float = TARGET_REWARD, window: int = REWARD_WINDOW) -> int | None:
    """The step at which the rolling `window`-step mean reward first reaches `target` (None: never)."""
    for i in range(window, len(rewards) + 1):
        if statistics.mean(rewards[i - window:i]) >= target:
            return i
    return None


def time_to_reward(rewards: list[float], step_s: list[float]) -> float:
    """Seconds of steps until `steps_to_reward` (nan: never): learning per second, which completions per
    second alone does not show."""
    reached = steps_to_reward(rewards)
    return sum(step_s[:reached]) if reached is not None else float("nan")


def _finite_mean(xs: list[float]) -> float:
    """Mean over the steps that have the value (a skipped step runs no token through the trainer)."""
    xs = [x for x in xs if x == x]
    return statistics.mean(xs) if xs else float("nan")


def child(arm: str, steps: int, seed: int, threads: int, stop_at_reward: bool, result: Path) -> None:
    import torch

    torch.set_num_threads(threads)
    out = Path(tempfile.mkdtemp(prefix=f"vs-trl-{arm}-"))
    shape = model_size()  # before the clock starts: it is not part of any step

    def report(r: dict, complete: bool = False) -> bool:
        """Write the measurements so far (after every step), atomically: a deadline can stop the arm.
        True when `stop_at_reward` and the arm has reached the reward: the arm stops after this step."""
        r = {**r, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "params": shape[0],
             "prompt_tokens": shape[1], "complete": complete}
        partial = result.with_suffix(".tmp")
        partial.write_text(json.dumps(r))
        partial.replace(result)
        return stop_at_reward and steps_to_reward(r["rewards"]) is not None

    report((run_trl if ARMS[arm][0] == "trl" else run_swarmrl)(arm, steps, seed, out, report), complete=True)


def run_arms(args) -> list[dict]:
    """Each (arm, seed) in its own process, `args.parallel` at a time; summaries in arm, then seed, order."""
    scratch, started = Path(tempfile.mkdtemp(prefix="vs-trl-")), time.perf_counter()
    print(f"results of each arm, after every step: {scratch}", flush=True)
    queue, running, rows = [(a, seed) for seed in args.seeds for a in args.arms], {}, {}

    def finish(job: tuple[str, int], code: int) -> None:
        arm, seed = job
        result = scratch / f"{arm}-s{seed}.json"
        r = json.loads(result.read_text()) if result.is_file() else {"step_s": []}  # the other arms still report
        if not r["step_s"]:
            print(f"arm {arm} seed {seed}: the process exited with {code} before it finished a step", flush=True)
            return
        if code != 0:  # the measurements stand; say how the process ended rather than drop the arm
            print(f"arm {arm} seed {seed}: the process exited with {code} after {len(r['step_s'])} step(s)", flush=True)
        rows[job] = summary(arm, seed, r)
        print(f"{arm} seed {seed}: ended at {time.perf_counter() - started:.0f} s; {json.dumps(rows[job])}", flush=True)

    while queue or running:
        while queue and len(running) < args.parallel:
            arm, seed = job = queue.pop(0)
            running[job] = subprocess.Popen(
                [sys.executable, __file__, "--child", arm, "--steps", str(args.steps), "--threads", str(args.threads),
                 "--seeds", str(seed), "--result", str(scratch / f"{arm}-s{seed}.json")]
                + (["--stop-at-reward"] if args.stop_at_reward else []),
                env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
            for arm, seed in queue:
                print(f"arm {arm} seed {seed}: not started before the deadline", flush=True)
            queue = []
            for proc in running.values():
                proc.terminate()
        for job, proc in list(running.items()):
            code = proc.poll()
            if code is not None:
                del running[job]
                finish(job, code)
        time.sleep(1.0)
    return [rows[job] for job in sorted(rows, key=lambda j: (args.arms.index(j[0]), j[1]))]


def _median_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f} [{min(xs):.0f}-{max(xs):.0f}]" if xs else "-"


def print_seeds(rows: list[dict]) -> None:
    """Per arm over its seeds: the median (and range) of the seconds and steps to the reward, and learning
    per second and steps against TRL's medians. A seed that never got there is counted, not averaged in."""
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    medians = {}
    print(f"\nover seeds: {'arm':<22} {'reached':>7} {'s to reward [range]':>20} {'steps [range]':>14} {'s/step':>6}")
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        got = [r for r in mine if r["to_reward_steps"] is not None]
        seconds, steps = [r["to_reward_s"] for r in got], [r["to_reward_steps"] for r in got]
        medians[arm] = (statistics.median(seconds), statistics.median(steps)) if got else (float("nan"), float("nan"))
        print(f"            {arm:<22} {len(got):>3}/{len(mine):<3} {_median_range(seconds):>20} {_median_range(steps):>14} "
              f"{statistics.median(r['s_step'] for r in mine):>6.2f}")
    for lora in ("", "-lora"):
        trl = medians.get(f"trl{lora}")
        for arm in (a for a in arms if a.startswith(f"swarmrl{lora}-") and trl):
            print(f"vs_trl_seeds: {arm} learning_per_s={trl[0] / medians[arm][0]:.2f}x "
                  f"steps_ratio={medians[arm][1] / trl[1]:.2f} (median seconds and steps to the reward, TRL's over ours "
                  f"and ours over TRL's; seeds {sorted({r['seed'] for r in rows})})")


def print_table(rows: list[dict], ran: str) -> None:
    print(f"\n{'arm':<22} {'seed':>4} {'s/step':>6} {'compl/s':>7} {'train s':>7} {'rollout s':>9} {'0-adv':>5} {'RSS GB':>6} "
          f"{'r first3':>8} {'r last3':>7} {'limit':>5} {'wasted':>6} {'|dlogp|':>8} {'to 0.5 s':>8} {'steps':>5}")
    for r in rows:
        print(f"{r['arm']:<22} {r['seed']:>4} {r['s_step']:>6.2f} {r['cps']:>7.2f} {r['train_s']:>7.2f} {r['rollout_s']:>9.2f} "
              f"{r['zero_adv']:>2}/{r['steps']:<2} {r['rss_gb']:>6.2f} {r['first3']:>8.3f} {r['last3']:>7.3f} "
              f"{r['limit']:>5.2f} {r['wasted']:>6.3f} {r['logp_diff']:>8.5f} {r['to_reward_s']:>8.0f} "
              f"{r['to_reward_steps'] or '-':>5}" + ("  (partial: stopped at the deadline)" if r["partial"] else ""))
    print(f"{ran}; limit = achieved fraction of the compute limit (see FLOPS); "
          "0-adv = steps whose every group had one reward (TRL and swarmrl's default both step on momentum); "
          "|dlogp| = mean |trainer - behaviour logprob| per trained token (train/behaviour_logp_diff); "
          f"to {TARGET_REWARD} s / steps = seconds and steps until the rolling {REWARD_WINDOW}-step mean reward "
          f"reached {TARGET_REWARD} (nan, -: never)")
    print("\nmean reward by step (the reward curves):")
    for r in rows:
        print(f"{r['arm']:<22} {r['seed']:>4} " + " ".join(f"{x:.3f}" for x in r["rewards"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="each arm runs once per seed (issue 43: 3 a side)")
    ap.add_argument("--stop-at-reward", action="store_true",
                    help=f"an arm stops once its rolling mean reward reaches {TARGET_REWARD} (the time to it is the figure)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--parallel", type=int, default=1, help="arms run at once (same load for all on a shared machine)")
    ap.add_argument("--deadline-s", type=float, help="stop arms still running after this many seconds; report their steps")
    ap.add_argument("--from-dir", type=Path, help="print the table of the arms' results saved in this folder")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.steps, args.seeds[0], args.threads, args.stop_at_reward, args.result)
    if args.from_dir:  # results of an earlier invocation (its folder is printed at the start)
        saved = {(a, seed): args.from_dir / f"{a}-s{seed}.json" for a in args.arms for seed in args.seeds}
        rows = [summary(a, seed, r) for (a, seed), f in saved.items() if f.is_file() and (r := json.loads(f.read_text()))["step_s"]]
        ran = f"re-printed from {args.from_dir}"
    else:
        rows = run_arms(args)
        ran = (f"torch threads {args.threads}; {args.parallel} arm(s) at a time; load average {os.getloadavg()[0]:.1f} "
               f"on {os.cpu_count()} cores at the end")
    print_table(rows, ran)
    print_seeds(rows)
    first = {r["arm"]: r for r in reversed(rows)}  # each arm's first seed, for the one-seed line of earlier rounds
    ratio = {k: first[k]["cps"] / first["trl"]["cps"] if k in first and "trl" in first else float("nan")
             for k in ("swarmrl-onpolicy", "swarmrl-async")}
    print(f"vs_trl: onpolicy_ratio={ratio['swarmrl-onpolicy']:.2f} async_ratio={ratio['swarmrl-async']:.2f}")


if __name__ == "__main__":
    main()
