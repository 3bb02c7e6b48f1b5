"""Drives a study and kill -9s its own process at one named point: the durability test's victim.

usage: crash_driver.py STUDIES_DIR NAME BRIEF TARGET
TARGET is `event` or `node:NAME` (the study's own progress events), or `-` to run without a kill.
Exit 0: the study finished; 3: it waits for a review; killed: -9.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
from pathlib import Path
from typing import Any

from researcher.planner.types import PlannerSpec
from researcher.study.runner import new_study, run_study
from researcher.study.store import study_paths

WAITING = 3
atexit.register(gc.freeze)  # as researcher.cli.main does: no final collection over LangGraph and MLflow at exit


def main() -> int:
    studies, name, brief, target = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    event, _, node = target.partition(":")
    paths = study_paths(studies, name)
    if not paths.meta.exists():
        new_study(studies, brief, name, PlannerSpec(), Path.cwd(), os.environ.get("MLFLOW_TRACKING_URI"))

    def emit(ev: str, **info: Any) -> None:
        if ev == event and (not node or info.get("node") == node):
            os.kill(os.getpid(), signal.SIGKILL)

    outcome = run_study(paths, emit, wait_for_review=False)
    return 0 if outcome.done else WAITING


if __name__ == "__main__":
    sys.exit(main())
