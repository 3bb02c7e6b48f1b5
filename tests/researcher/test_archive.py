"""`make demo` reruns: a study moved aside frees its name, folder and MLflow experiment for a fresh one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from researcher.planner.types import PlannerSpec
from researcher.records import Proposal
from researcher.study.archive import PREVIOUS, archive, main
from researcher.study.runner import new_study, open_board
from researcher.study.store import StudyError, StudyLock, list_studies

ROOT = Path(__file__).resolve().parents[2]


def _start(studies: Path, name: str):
    paths, meta, _ = new_study(studies, ROOT / "studies" / "tiny-lr.md", name, PlannerSpec(), ROOT,
                               os.environ["MLFLOW_TRACKING_URI"])
    return paths, meta


def test_a_study_moved_aside_frees_its_name_and_review_board(tmp_path: Path) -> None:
    studies = tmp_path / "studies"
    paths, meta = _start(studies, "demo")
    open_board(meta).publish(Proposal(id="r1-0", round=1, planner="heuristic", hypothesis="an old hypothesis", rationale="an old rationale",
                                      expected_effect="no effect", overrides={}), {})
    with pytest.raises(StudyError, match="already exists"):
        _start(studies, "demo")
    moved = archive(studies, "demo")
    assert moved is not None and moved.parent == studies / PREVIOUS and (moved / ".study" / "study.json").is_file()
    assert list_studies(studies) == []  # the moved study is out of the listing
    _, fresh = _start(studies, "demo")
    assert open_board(fresh).find("r1-0") is None  # the new study does not inherit old proposals
    client = MlflowClient(meta.tracking_uri)
    old = [e.name for e in client.search_experiments() if e.name.startswith("study-demo-")]
    assert len(old) == 1 and old[0].endswith(moved.name.removeprefix("demo-"))


def test_nothing_to_move_is_fine_and_a_running_study_is_refused(tmp_path: Path, capsys) -> None:
    studies = tmp_path / "studies"
    assert main(["demo", "--studies-dir", str(studies)]) == 0
    paths, _ = _start(studies, "busy")
    with StudyLock(paths):
        assert main(["busy", "--studies-dir", str(studies)]) == 2
    assert "is running" in capsys.readouterr().err and paths.root.is_dir()
