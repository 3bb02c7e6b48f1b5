"""Wall time of a slice of the test suite, serial against pytest-xdist workers, side by side.

Each arm is one fresh `pytest` process over the same selection (default: `tests/core -m "not slow"`),
run one after the other: serial, then `-n N --dist loadgroup` as `make test` runs it, and again if
`--repeats 2`. The table gives each arm's wall time, its CPU time (user + system of pytest and
everything it started) and the ratio of its wall time to the first serial arm's. On a busy machine
the ratio understates what 2 workers gain on an idle one: the workers compete with other load.

    .venv/bin/python bench/suite_workers.py [--workers 2] [--repeats 1] [-- PYTEST_ARGS ...]

It measures; it does not fix failures (a failing test counts as run, and the table says how many).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SELECTION = ["tests/core", "-m", "not slow"]


def run_arm(extra: list[str], selection: list[str]) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *selection],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", done.stdout, re.M)
    return wall, cpu, summary[-1] if summary else done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("pytest_args", nargs="*", help="selection after --, default: tests/core -m 'not slow'")
    args = parser.parse_args()
    selection = args.pytest_args or DEFAULT_SELECTION
    arms = [("serial", []), (f"xdist -n {args.workers}", ["-n", str(args.workers), "--dist", "loadgroup"])]
    rows = []
    for _ in range(args.repeats):
        for name, extra in arms:
            rows.append((name, *run_arm(extra, selection)))
    base = rows[0][1]
    print(f"{'arm':<12} {'wall s':>8} {'cpu s':>8} {'wall / serial':>14}  result")
    for name, wall, cpu, result in rows:
        print(f"{name:<12} {wall:>8.1f} {cpu:>8.1f} {wall / base:>14.2f}  {result}")


if __name__ == "__main__":
    main()
