"""Start-up time of the commands people type first, for one or more source trees side by side.

Times, as fresh processes from the venv's Python:
- `swarm --help` and `researcher --help`;
- `researcher study status NAME` on a study created for the purpose (nothing has run in it);
- `swarm run configs/tiny.yaml` until its log line for step 1, and until the process exits (1 step):
  the gap is the run's shutdown (clients, server, MLflow run) and Python's own teardown.

Each tree is a checkout of this project (`--tree DIR`, default this one); another commit's tree is
made with `git archive <commit> | tar -x -C DIR`. Trees run with the same venv, `PYTHONPATH` set to
the tree. `--no-bytecode` adds an arm per tree that ignores every compiled `.pyc` (an empty
`PYTHONPYCACHEPREFIX`), as on a venv installed without compiling bytecode under
`PYTHONDONTWRITEBYTECODE=1`. Arms alternate within each repeat, so they share the machine's load;
the table gives the median wall time and the median CPU time (user + system, which a busy machine
inflates less) and each later arm's wall time over the first arm's.

    .venv/bin/python bench/startup.py [--tree DIR ...] [--no-bytecode] [--repeats 3]

It measures; it does not change anything in the trees (studies, MLflow stores and checkpoints go to
a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = "startup-bench"
STEP_LINE = "step 1 reward"  # what `swarm run` logs when its first step is done
SETUP_STUDY = (  # creates the study the way `researcher study start` does, without running anything
    "import sys; from pathlib import Path; from researcher.planner.types import PlannerSpec; "
    "from researcher.study.runner import new_study; "
    "new_study(Path(sys.argv[1]), Path('studies/tiny-lr.md'), sys.argv[2], PlannerSpec(kind='heuristic'), Path.cwd(), sys.argv[3]); "
    # The tracking store is created here too: its one-time schema migrations would otherwise land on
    # whichever arm touches it first.
    "from mlflow.tracking import MlflowClient; MlflowClient(sys.argv[3]).search_experiments()"
)


@dataclass
class Arm:
    label: str
    tree: Path
    bytecode: bool


@dataclass
class Timing:
    wall: float  # seconds until the marker (or exit)
    cpu: float  # user + system seconds of the child until exit


def commands(scratch: Path) -> dict[str, tuple[list[str], str | None]]:
    py = sys.executable
    return {
        "swarm --help": ([py, "-m", "core.run.cli", "--help"], None),
        "researcher --help": ([py, "-m", "researcher.cli.main", "--help"], None),
        "researcher study status": ([py, "-m", "researcher.cli.main", "study", "--studies-dir", str(scratch / "studies"),
                                     "status", STUDY], None),
        "swarm run tiny: first step": ([py, "-m", "core.run.cli", "run", "configs/tiny.yaml", "-q",
                                        "--set", "trainer.steps=1",
                                        "--set", f"trainer.checkpoint_dir={scratch / 'ckpt'}"], STEP_LINE),
    }


def environment(arm: Arm, scratch: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(arm.tree), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{scratch}/mlflow.db", "TOKENIZERS_PARALLELISM": "false"}
    if not arm.bytecode:
        env["PYTHONPYCACHEPREFIX"] = str(scratch / "no-pyc")  # an empty cache: every module compiles from source
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def timed(cmd: list[str], cwd: Path, env: dict[str, str], marker: str | None) -> tuple[Timing, Timing | None]:
    """(until the process exits, until `marker` appeared in its output or None without a marker)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    seen: float | None = None
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:  # type: ignore[union-attr]
        tail = (tail + [line])[-20:]
        if marker and seen is None and marker in line:
            seen = time.perf_counter() - start
    code = proc.wait()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if code != 0 or (marker and seen is None):
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}) in {cwd}:\n{''.join(tail)}")
    return Timing(wall, cpu), (Timing(seen, cpu) if seen is not None else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", type=Path, help="a source tree to time (repeatable; default: this one)")
    ap.add_argument("--no-bytecode", action="store_true", help="also time each tree with compiled bytecode ignored")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="+", help="time only these commands (names as in the table)")
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    arms = [Arm(f"{t.name}{'' if b else ' (no .pyc)'}", t, b) for t in trees for b in ((True, False) if args.no_bytecode else (True,))]
    scratch = Path(tempfile.mkdtemp(prefix="swarmrl-startup-"))
    scratches = {t: scratch / f"tree{i}" for i, t in enumerate(trees)}  # each tree reads only what its own code wrote
    for tree, own in scratches.items():  # a study for `status` to read
        own.mkdir()
        subprocess.run([sys.executable, "-c", SETUP_STUDY, str(own / "studies"), STUDY, f"sqlite:///{own}/mlflow.db"],
                       cwd=tree, env=environment(Arm("setup", tree, True), own), check=True, capture_output=True)
    names = [n for n in commands(scratch) if not args.only or n in args.only]
    results: dict[tuple[str, str], list[tuple[Timing, Timing]]] = {}  # (to the marker or exit, to exit)
    for repeat in range(args.repeats):
        for name in names:
            for arm in arms:
                own = scratches[arm.tree]
                cmd, marker = commands(own)[name]
                total, first = timed(cmd, arm.tree, environment(arm, own), marker)
                results.setdefault((name, arm.label), []).append((first or total, total))
                print(f"repeat {repeat + 1} {name:<28} {arm.label:<24} {(first or total).wall:6.2f} s wall "
                      f"{total.wall:6.2f} s to exit {total.cpu:6.2f} s cpu", flush=True)
    load = os.getloadavg()[0]
    header = f"{'command':<28}" + "".join(f" | {a.label[:22]:>22} wall  exit   cpu" for a in arms) + (" | wall / first arm's" if len(arms) > 1 else "")
    print(f"\nmedian of {args.repeats}; load average at the end {load:.1f} on {os.cpu_count()} cores\n{header}")
    for name in names:
        cells, walls = [], []
        for arm in arms:
            runs = results[(name, arm.label)]
            wall, cpu = statistics.median(r.wall for r, _ in runs), statistics.median(t.cpu for _, t in runs)
            walls.append(wall)
            cells.append(f" | {'':>16}{wall:6.2f} {statistics.median(t.wall for _, t in runs):6.2f} {cpu:5.2f}")
        ratio = " | " + " ".join(f"{w / walls[0]:.2f}x" for w in walls[1:]) if len(arms) > 1 else ""
        print(f"{name:<28}{''.join(cells)}{ratio}")


if __name__ == "__main__":
    main()
