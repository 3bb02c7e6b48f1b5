"""Learning per step and per second: the core's default against each issue-43 option, side by side.

One run (no `--options`): trains `--config` through the real loop (server, sandbox clients, trainer),
prints `step N reward R (Ts)` per step, and reports the mean reward of the first and last 5 steps,
the step-to-step noise and the margin in units of that noise, with the reward curve as a PNG.
`--from-log` makes the same report from the printed log of a run that was stopped early.

Comparison (`--options`): the default arm and one arm per option (each a set of `--set`-style
overrides, `;`-separated within an arm), `--seeds` seeds each, every (arm, seed) its own process run
one after another with the same thread count, on-policy (`trainer.max_staleness=0`) with
`engine.repeatable_sampling` and each client's concurrency capped at one step's episodes
(`one_step_in_flight`), so that one seed trains the same tasks at each step and draws the same first
samples in every arm. It prints,
per arm: the median (and range) of the seconds and the steps to a rolling `--window`-step mean reward
of `--threshold` (a seed that never gets there counts as not reached, and the median is over the seeds
that did, with how many), trained tokens per second, the groups dynamic sampling kept out
(`train/groups_filtered`, summed over the run) and the mean `train/mismatch_kl`. The last line:
`learning: <arm>=<median s>/<median steps> ...` (`-` where no seed reached the threshold). `--records DIR`
(the folder a comparison prints) keeps its runs that logged steps and runs the rest, so a comparison
cut short or with a failed run is finished without running again what it has. `--parallel N` runs N
at a time, the arms of one seed side by side (the same load for each; the steps do not depend on it).

    .venv/bin/python bench/learning.py [--config configs/smollm2-oneword.yaml] [--steps 40] [--out bench/out]
    .venv/bin/python bench/learning.py --config configs/smollm2-guess.yaml --from-log run.log
    .venv/bin/python bench/learning.py --config configs/tiny.yaml --steps 20 --seeds 0 1 2 --threshold 0.5 \\
        --options trainer.dynamic_sampling=filter trainer.loss=cispo "trainer.correction=token_mis;trainer.tis_cap=2" \\
                  trainer.credit=turn trainer.no_signal_steps=skip

It measures and prints; it asserts nothing. Where its figures come from a loaded machine, docs/benchmarks.md says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from core.config_io import load_config  # noqa: E402

STEP_LINE = re.compile(r"^step +(\d+) reward (-?[\d.]+) \((\d+)s\)")  # what a run prints per step
# What each step keeps for the comparison table (absent metrics are NaN: an option that is off logs none).
KEPT = ("reward/mean", "train/trained_tokens", "train/groups_filtered", "train/mismatch_kl", "train/updated")
# Comparison runs are on-policy and repeatable: the options change the update, not what overlapping
# generation and arrival order would add to the noise (issue 43: two runs of one seed parted without these).
COMPARISON_SETTINGS = ("trainer.max_staleness=0", "engine.repeatable_sampling=true")


def one_step_in_flight(config: str) -> list[str]:
    """Overrides that cap each client's concurrency at one step's episodes (`batch_groups` x its group size):
    on-policy, admission lets only that many train, and the opens it holds back beyond them race for
    the next step's room, so which tasks a step trains (and a seed's rewards) would depend on timing."""
    cfg = load_config(config)
    rooms = [cfg.trainer.batch_groups * (c.group_size or cfg.trainer.group_size) for c in cfg.clients]
    return [f"clients.{i}.concurrency={room}"
            for i, (client, room) in enumerate(zip(cfg.clients, rooms)) if client.concurrency > room]


def run(config: str, overrides: list[str]) -> tuple[list[dict[str, float]], float]:
    """Train from `config` through the real server, clients and trainer: (kept metrics per step, wall seconds)."""
    from core.run.loop import CoreRun  # the whole core (torch, the server): only a live run needs it, not --from-log

    cfg = load_config(config, overrides)
    core = CoreRun(cfg)
    steps: list[dict[str, float]] = []
    start = time.time()

    def on_step(step: int, m: dict) -> None:
        steps.append({k: float(m.get(k, float("nan"))) for k in KEPT} | {"time_s": time.time() - start})
        print(f"step {step:3d} reward {m['reward/mean']:.3f} ({time.time() - start:.0f}s)", flush=True)

    core.server.start()
    try:
        core.start_clients()
        core.train(on_step=on_step)
    finally:
        core.stop_clients()
        core.server.stop()
    return steps, time.time() - start


def from_log(path: Path) -> tuple[list[dict[str, float]], float]:
    """(reward per step, wall seconds at the last step) from the printed log of a run."""
    steps = [STEP_LINE.match(line) for line in path.read_text().splitlines()]
    found = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in steps if m]
    if not found or [s for s, _, _ in found] != list(range(1, len(found) + 1)):
        raise SystemExit(f"{path}: no consecutive `step N reward R (Ts)` lines from step 1")
    return [{"reward/mean": r, "time_s": t} for _, r, t in found], found[-1][2]


def reached(steps: list[dict[str, float]], threshold: float, window: int) -> tuple[int, float] | None:
    """(step, seconds) at which the rolling `window`-step mean reward first reaches `threshold`; None if never."""
    rewards = [s["reward/mean"] for s in steps]
    for i in range(window, len(rewards) + 1):
        if statistics.mean(rewards[i - window:i]) >= threshold:
            return i, steps[i - 1]["time_s"]
    return None


def summary(runs: list[list[dict[str, float]]], threshold: float, window: int) -> dict[str, object]:
    """One arm's row over its seeds' runs."""
    hits = [h for h in (reached(r, threshold, window) for r in runs) if h is not None]
    finite = lambda xs: [x for x in xs if x == x]  # noqa: E731  (NaN: the metric was not logged)
    tokens = sum(sum(finite([s["train/trained_tokens"] for s in r])) for r in runs)
    seconds = sum(r[-1]["time_s"] for r in runs if r)
    kl = finite([s["train/mismatch_kl"] for r in runs for s in r])
    return {"reached": len(hits), "seeds": len(runs), "failed": sum(1 for r in runs if not r),
            "steps": [h[0] for h in hits], "seconds": [h[1] for h in hits],
            "tokens_per_s": tokens / seconds if seconds else float("nan"),
            "groups_filtered": sum(sum(finite([s["train/groups_filtered"] for s in r])) for r in runs),
            "mismatch_kl": statistics.mean(kl) if kl else float("nan")}


def run_jobs(jobs: list[tuple[str, list[str]]], parallel: int, env: dict[str, str]) -> None:
    """Each (name, command) as its own process, `parallel` at a time; a run that fails is reported and
    left out of its arm (its seed counts as logging no step), the others go on."""
    waiting, running = list(jobs), {}
    while waiting or running:
        while waiting and len(running) < parallel:
            name, cmd = waiting.pop(0)
            print(f"== {name}", flush=True)
            running[name] = subprocess.Popen(cmd, env=env)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                print(f"== {name}: {'done' if proc.returncode == 0 else f'exited with {proc.returncode}'}", flush=True)
        time.sleep(1.0)


def steps_of(record: Path) -> list[dict[str, float]]:
    """A comparison run's kept metrics per step; none when it failed before writing them."""
    return json.loads(record.read_text())["steps"] if record.is_file() else []


def spread(xs: list[float], fmt: str) -> str:
    """median [min-max]; `fmt` applies to floats (the median of an even count of steps is one)."""
    if not xs:
        return "-"
    median, low, high = (format(float(x), fmt) for x in (statistics.median(xs), min(xs), max(xs)))
    return f"{median} [{low}-{high}]"


def compare(args: argparse.Namespace) -> None:
    arms = {"default": []} | {arm: [s for s in arm.split(";") if s] for arm in args.options}
    out = args.records or Path(tempfile.mkdtemp(prefix="learning-"))
    record = lambda index, seed: out / f"{index}-{seed}.json"  # noqa: E731  (one arm's run of one seed)
    jobs = []  # seed-major: with --parallel, the arms of one seed run side by side, under the same load
    for seed in args.seeds:
        for index, (name, sets) in enumerate(arms.items()):
            done = record(index, seed)
            if done.is_file() and json.loads(done.read_text())["steps"]:  # --records: done before, kept
                continue
            cmd = [sys.executable, __file__, "--config", args.config, "--json", str(done), "--out", str(out),
                   "--set", f"trainer.seed={seed}", "--set", f"trainer.checkpoint_dir={out}/ckpt-{index}-{seed}",
                   "--set", f"telemetry.tracking_uri=sqlite:///{out}/mlflow-{index}-{seed}.db"]
            settings = (*COMPARISON_SETTINGS, *one_step_in_flight(args.config), *args.overrides, *sets)
            cmd += [a for s in settings for a in ("--set", s)]
            cmd += ["--steps", str(args.steps)] if args.steps else []
            jobs.append((f"{name} seed {seed}", cmd))
    run_jobs(jobs, args.parallel, {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    rows = {name: summary([steps_of(record(index, seed)) for seed in args.seeds], args.threshold, args.window)
            for index, name in enumerate(arms)}
    print(f"\nrecords: {out}")
    print(f"threshold: rolling {args.window}-step mean reward >= {args.threshold}; seeds {args.seeds}; "
          f"{args.config}, {args.steps or 'config'} steps")
    print(f"{'arm':<44} {'reached':>7} {'seconds to threshold':>22} {'steps to threshold':>19} "
          f"{'tok/s':>7} {'filtered':>8} {'mismatch_kl':>11}")
    for name, r in rows.items():
        reached_of = f"{r['reached']}/{r['seeds']}" + (f" ({r['failed']} runs logged no step)" if r["failed"] else "")
        print(f"{name:<44} {reached_of:<7} {spread(r['seconds'], '.0f'):>22} {spread(r['steps'], 'g'):>19} "
              f"{r['tokens_per_s']:>7.1f} {r['groups_filtered']:>8.0f} {r['mismatch_kl']:>11.2e}")
    last = " ".join(f"{name.replace(' ', '')}={spread(r['seconds'], '.0f').split(' ')[0]}/"
                    f"{spread(r['steps'], 'g').split(' ')[0]}" for name, r in rows.items())
    print(f"learning: {last}")


def report(cfg_source: str, config: str, steps: list[dict[str, float]], wall: float, out: Path) -> None:
    rewards = [s["reward/mean"] for s in steps]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    noise = statistics.pstdev([b - a for a, b in zip(rewards, rewards[1:])]) if len(rewards) > 2 else float("nan")
    out.mkdir(parents=True, exist_ok=True)
    png = out / "learning.png"
    plt.figure(figsize=(6, 3.5))
    plt.plot(range(1, len(rewards) + 1), rewards, marker=".")
    plt.xlabel("trainer step")
    plt.ylabel("mean reward")
    plt.title(f"{cfg_source}: {Path(config).stem}")
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(png, dpi=120)
    print(f"\n{'steps':>6} {'wall s':>7} {'first-5':>8} {'last-5':>7} {'noise':>6} {'margin/noise':>13}")
    print(f"{len(rewards):>6} {wall:>7.0f} {first:>8.3f} {last:>7.3f} {noise:>6.3f} {(last - first) / noise:>13.1f}")
    print(f"reward curve: {png}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-oneword.yaml")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--from-log", type=Path, help="report a stopped run from its printed log instead of training")
    ap.add_argument("--json", type=Path, help="write the run's kept metrics per step here (the comparison's children)")
    ap.add_argument("--options", nargs="*", default=None, help="arms against the default: overrides, ';' within an arm")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=1, help="comparison runs at once (the arms of a seed side by side)")
    ap.add_argument("--records", type=Path, help="the folder of an earlier comparison with the same arms: "
                                                 "its finished runs are kept, the others run")
    args = ap.parse_args()
    if args.options is not None:
        compare(args)
        return
    overrides = list(args.overrides) + ([f"trainer.steps={args.steps}"] if args.steps else [])
    cfg = load_config(args.config, overrides)
    steps, wall = from_log(args.from_log) if args.from_log else run(args.config, overrides)
    if args.json:
        args.json.write_text(json.dumps({"steps": steps, "wall_s": wall}))
        return
    report(cfg.models[0].source, args.config, steps, wall, Path(args.out))


if __name__ == "__main__":
    main()
