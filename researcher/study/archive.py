"""Move a finished (or abandoned) study aside, so that a new study can take its name: `make demo` reruns.

    python -m researcher.study.archive demo [--studies-dir studies]

The study's folder moves to `<studies>/.previous/<name>-<UTC time>/` (out of `researcher study list`)
and its MLflow experiment is renamed `study-<name>-<UTC time>` with it, so the new study starts with an
empty review board instead of finding the old proposals under the same ids. A study whose process
still runs is refused. Nothing is deleted. This module does not start or resume studies.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from researcher.study.store import StudyError, load_meta, owner_pid, study_paths

PREVIOUS = ".previous"  # under the studies folder; dot-named so that listings skip it


def archive(studies_dir: Path, name: str) -> Path | None:
    """Move study `name` aside; returns where it went, or None when there was no such study."""
    paths = study_paths(studies_dir, name)
    if not paths.root.exists():
        return None
    pid = owner_pid(paths)
    if pid:
        raise StudyError(f"study {name} is running (pid {pid}); stop it first: researcher study stop {name}")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    if paths.meta.is_file():
        meta = load_meta(paths)
        client = MlflowClient(meta.tracking_uri)
        found = client.get_experiment_by_name(meta.experiment)
        if found is not None:
            client.rename_experiment(found.experiment_id, f"{meta.experiment}-{stamp}")
    target = studies_dir / PREVIOUS / f"{name}-{stamp}"
    target.parent.mkdir(parents=True, exist_ok=True)
    paths.root.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--studies-dir", type=Path, default=Path("studies"))
    args = parser.parse_args(argv)
    try:
        moved = archive(args.studies_dir, args.name)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if moved is not None:
        print(f"previous study {args.name} moved to {moved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
