"""One sealed judge per study (issue 38, item 4): the judges of the base commit are copied into the study's state
with their digests, every run the study launches is told to load them from there (`server.judges_dir`), and a
sealed folder that changed, lost a file or gained one (a planted `__pycache__`) starts no run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from core.config_io import load_config
from core.sandbox.judge import JudgeEpisode, load_judges
from researcher.brief.schema import Brief
from researcher.code.sealed import SealError, seal, verify
from researcher.code.workspace import Workspace
from researcher.records import Edit, Launch
from researcher.review.report import render
from researcher.runs.launcher import Launcher, LaunchTarget
from researcher.study.store import study_paths
from tests.researcher.helpers import make_brief

ROOT = Path(__file__).resolve().parents[2]
CHEAT = "\n\ndef reward(text, task=None):  # a proposal's judge: everything scores 1\n    return 1.0\n"


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "sandboxes" / "letters", project / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    brief = make_brief(project, "  agent:\n    kind: code\n    paths: [sandboxes/letters/agent.py]",
                       "code:\n  editable: [sandboxes/letters/]")
    workspace = Workspace(tmp_path / "workspace", brief.code, project)
    workspace.base()
    return workspace


def _launcher(tmp_path: Path, judges: Path | None) -> Launcher:
    target = LaunchTarget(command=["swarm", "run"], workdir=ROOT, tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
                          experiment="e", study="s", judges=judges)
    return Launcher(target, tmp_path / "state", grace_s=1, emit=lambda *a, **k: None)


def _launch(commit: str) -> Launch:
    return Launch(key=f"p-{commit or 'base'}", proposal_id="p", seed=0, steps=2, commit=commit,
                  config_path=str(ROOT / "configs" / "tiny.yaml"))


def test_the_base_judge_and_what_it_imports_are_sealed_with_their_digests(ws: Workspace, tmp_path: Path) -> None:
    record = seal(ws, tmp_path / "judges", ws.base())
    (letters,) = record.judges
    assert (letters.sandbox, letters.source) == ("letters", "sandboxes/letters")
    assert {"sandbox.toml", "judge.py", "reward.py"} <= set(letters.files)
    assert "agent.py" not in letters.files  # the agent is what proposals change; it is not the yardstick
    assert (tmp_path / "judges" / "letters" / "reward.py").read_bytes() == (ws.root / "sandboxes/letters/reward.py").read_bytes()
    assert verify(tmp_path / "judges") == record
    assert len(record.digest()) == 64


def test_a_resumed_study_keeps_the_judge_it_sealed_whatever_the_workspace_holds_later(ws: Workspace, tmp_path: Path) -> None:
    first = seal(ws, tmp_path / "judges", ws.base())
    (ws.root / "sandboxes/letters/reward.py").write_text(CHEAT)  # whatever happens to the base folder afterwards
    assert seal(ws, tmp_path / "judges", ws.base()) == first
    assert "return 1.0" not in (tmp_path / "judges/letters/reward.py").read_text()


def test_every_arm_is_scored_by_the_sealed_judge_not_the_one_in_its_checkout(ws: Workspace, tmp_path: Path) -> None:
    sealed = tmp_path / "judges"
    seal(ws, sealed, ws.base())
    launcher = _launcher(tmp_path, sealed)
    for commit in ("", "abc123"):  # a baseline at the base and a candidate at its commit
        argv = launcher.argv(_launch(commit))
        overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        assert f"server.judges_dir={sealed}" in overrides
    # What the core does with it: a checkout whose reward.py scores everything 1.0 is not the judge.
    checkout = tmp_path / "checkout"
    shutil.copytree(ws.root / "sandboxes", checkout / "sandboxes")
    with (checkout / "sandboxes/letters/reward.py").open("a") as f:
        f.write(CHEAT)
    cfg = load_config({"clients": [{"agent": str(checkout / "sandboxes/letters")}]}, [f"server.judges_dir={sealed}"])
    judge = load_judges(cfg)["letters"]
    assert judge.file == (sealed / "letters" / "judge.py").resolve()
    episode = JudgeEpisode(task_id="t", kind="train", calls=[], completion="zzzz", completions=["zzzz"],
                           tool_calls=[], messages=[])
    task = next(iter(judge.tasks("train")))
    assert judge.score(task, episode)[0] < 1.0


@pytest.mark.parametrize("tamper", ["change", "plant_pycache", "delete"])
def test_a_sealed_judge_that_changed_starts_no_run_and_says_which_file(ws: Workspace, tmp_path: Path, tamper: str) -> None:
    sealed = tmp_path / "judges"
    seal(ws, sealed, ws.base())
    if tamper == "change":
        (sealed / "letters/reward.py").write_text(CHEAT)
        why = r"letters/reward.py: changed since the study sealed it"
    elif tamper == "plant_pycache":
        (sealed / "letters/__pycache__").mkdir()
        (sealed / "letters/__pycache__/reward.cpython-311.pyc").write_bytes(b"\0")
        why = r"reward.cpython-311.pyc: a file the study did not seal"
    else:
        (sealed / "letters/judge.py").unlink()
        why = r"letters/judge.py: a sealed judge file is missing"
    with pytest.raises(SealError, match=why):
        verify(sealed)
    launched = _launcher(tmp_path, sealed).start(_launch("abc123"), MlflowClient(f"sqlite:///{tmp_path / 'm.db'}"))
    assert launched.status == "failed" and launched.pid is None
    assert (launched.reason or "").startswith("not started: ") and str(sealed / "letters") in (launched.reason or "")


def test_a_study_that_edits_no_code_leaves_its_runs_judges_where_they_are(tmp_path: Path) -> None:
    argv = _launcher(tmp_path, None).argv(_launch(""))
    assert not [a for a in argv if a.startswith("server.judges_dir")]


def test_an_edit_cannot_reach_the_sealed_copy(ws: Workspace, tmp_path: Path) -> None:
    """The proposal's own edits land in its commit; the sealed copy is outside the workspace altogether."""
    sealed = tmp_path / "judges"
    seal(ws, sealed, ws.base())
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    ws.apply_edits(tree, [Edit(file="sandboxes/letters/agent.py", search="MAX_TOKENS = 12", replace="MAX_TOKENS = 8")])
    assert not sealed.resolve().is_relative_to(ws.root.resolve())
    verify(sealed)


def test_the_report_names_the_sealed_judge_every_run_was_scored_by(ws: Workspace, tmp_path: Path) -> None:
    record = seal(ws, tmp_path / "judges", ws.base())
    brief = Brief.model_validate({"objective": {"metric": "reward/mean"}, "run": {"base_config": "base.yaml"},
                                  "search_space": {"lr": {"kind": "choice", "values": [1e-5]}}})
    paths = study_paths(tmp_path / "studies", "s")
    paths.root.mkdir(parents=True)
    state = {"proposals": [], "sealed_judges": record.model_dump()}
    markdown = render("s", brief, state, MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"), paths, {})
    assert f"Judges: sealed at study start from base commit `{ws.base()[:12]}` (letters (" in markdown
    assert "never by the judge in the code it ran" in markdown
