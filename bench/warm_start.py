"""A short `swarm run` started cold against the same run forked from `swarm warm`, side by side.

Each repeat runs `swarm run configs/tiny.yaml` for `--steps` steps twice, alternating which arm goes
first: once cold (a fresh process imports torch, transformers, MLflow and the server) and once with
SWARMRL_WARM naming a `swarm warm` process started here (core.run.warm). A forked run is not a
child of this script, so CPU is the machine's: the busy time in /proc/stat over the run, every
process included (the run, its client, the launcher), which is exact only on a quiet machine; the
load average is printed with the table.

    .venv/bin/python bench/warm_start.py [--repeats 5] [--steps 2]

It measures; the runs' MLflow store and checkpoints go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWARM = Path(sys.executable).parent / "swarm"
TICKS = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICKS


def one_run(scratch: Path, env: dict[str, str], steps: int) -> tuple[float, float, str]:
    """(wall s, machine CPU s, output) of one `swarm run` to its exit."""
    cmd = [str(SWARM), "run", "configs/tiny.yaml", "-q", "--set", f"trainer.steps={steps}",
           "--set", f"trainer.checkpoint_dir={scratch / 'ckpt'}"]
    cpu, start = busy_seconds(), time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall, cpu = time.perf_counter() - start, busy_seconds() - cpu
    if done.returncode != 0 or f"step {steps} reward" not in done.stderr + done.stdout:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return wall, cpu, done.stdout + done.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="trainer steps per run (the study tests use 2-4)")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="swarmrl-warm-bench-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MLFLOW_TRACKING_URI": f"sqlite:///{scratch}/mlflow.db"}
    env.pop("SWARMRL_WARM", None)
    sock = scratch / "warm.sock"
    warm_log = open(scratch / "warm.log", "wb")
    start = busy_seconds()
    warm = subprocess.Popen([str(SWARM), "warm", "--socket", str(sock)], cwd=ROOT, env=env, stdout=warm_log,
                            stderr=subprocess.STDOUT)
    while not sock.exists():
        if warm.poll() is not None:
            raise RuntimeError((scratch / "warm.log").read_text())
        time.sleep(0.1)
    warm_cost = busy_seconds() - start
    one_run(scratch, env, 1)  # the store's schema migrations land on neither arm
    arms = {"cold": env, "warm": {**env, "SWARMRL_WARM": str(sock)}}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        for repeat in range(args.repeats):
            order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
            for name in order:
                wall, cpu, out = one_run(scratch, arms[name], args.steps)
                if name == "warm" and "starting cold" in out:
                    raise RuntimeError(f"the warm arm started cold:\n{out[-2000:]}")
                results[name].append((wall, cpu))
                print(f"repeat {repeat + 1} {name}: {wall:6.2f} s wall {cpu:6.2f} s machine CPU", flush=True)
    finally:
        warm.terminate()
        warm.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n`swarm run configs/tiny.yaml`, {args.steps} steps, median of {args.repeats}; load average at the end "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; `swarm warm` itself took {warm_cost:.1f} s of CPU once")
    print(f"{'arm':<6} | {'wall s':>7} | {'CPU s':>7} | {'cold / arm, wall':>16} | {'cold / arm, CPU':>15}")
    cold_wall, cold_cpu = (statistics.median(x[i] for x in results["cold"]) for i in (0, 1))
    for name, runs in results.items():
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"{name:<6} | {wall:7.2f} | {cpu:7.2f} | {cold_wall / wall:15.2f}x | {cold_cpu / cpu:14.2f}x")


if __name__ == "__main__":
    main()
