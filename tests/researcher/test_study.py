"""Whole studies with real `swarm run` processes, real MLflow and real LangGraph checkpoints."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.researcher.harness import DETERMINISTIC, ROOT, Project, lineage, write_brief

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)


def test_auto_approved_study_runs_to_its_report(project: Project) -> None:
    brief = write_brief(project.tmp, rounds=3)
    done = project.cli("start", str(brief), "--name", "auto", "--planner", "heuristic")
    assert "is done" in done.stdout and "report.md" in done.stdout
    values, _, _ = project.state("auto")
    assert values["stop_reason"].startswith("planner: heuristic planner (offline, no LLM)")
    keys = [x["key"] for x in values["launches"]]
    # rung 1: the survivor, and the baseline beside it as the reference unless it is the survivor
    assert keys[:3] == ["r1-1-s0", "r1-2-s0", "r2-1-s0"] and keys[3:] in ([], ["r2-2-s0"])
    assert all(x["status"] == "finished" for x in values["launches"])
    runs = project.runs("auto")
    launched = Counter(r.data.tags.get("swarmrl.launch") for r in runs if "swarmrl.launch" in r.data.tags)
    assert launched == Counter(keys)  # one MLflow run per launch, no duplicates
    for r in runs:
        if "swarmrl.launch" in r.data.tags:
            assert r.data.tags["swarmrl.study"] == "auto" and r.info.status == "FINISHED"
    proposals = [r for r in runs if r.data.tags.get("swarmrl.kind") == "proposal"]
    assert {r.info.status for r in proposals} == {"FINISHED"} and len(proposals) == len(values["proposals"])
    report = (project.studies / "auto" / "report.md").read_text()
    assert "## Lineage" in report and "r2-1" in report and (project.studies / "auto" / "report" / "curves.png").exists()
    page = (project.studies / "auto" / "report.html").read_text()
    assert "<h2>Lineage</h2>" in page and 'alt="curves" src="data:image/png;base64,' in page
    assert (project.studies / "auto" / ".study" / "runs" / "r1-1-s0" / "run.log").stat().st_size > 0


def test_human_review_waits_and_cli_decisions_resume_the_study(project: Project) -> None:
    brief = write_brief(project.tmp, approval="human", rounds=1)
    first = project.cli("start", str(brief), "--name", "human", "--planner", "heuristic", "--no-wait")
    assert "waits for review of r1-1, r1-2" in first.stdout
    status = project.cli("status", "human").stdout
    assert "waiting for decisions" in status and "r1-1" in status and "not running" in status
    bad = project.cli("veto", "human", "r1-1", "--reason", " ", check=False)
    assert bad.returncode == 2 and "a veto needs a --reason" in bad.stdout
    project.cli("veto", "human", "r1-1", "--reason", "baseline is known", "--by", "ada", "--no-resume")
    again = project.cli("approve", "human", "r1-1", "--by", "bob", "--no-resume", check=False)
    assert again.returncode == 2 and "already vetoed by ada; a decision is final" in again.stdout
    approved = project.cli("approve", "human", "r1-2", "--by", "bob", "--reason", "worth a look")
    assert "resumed in the background" in approved.stdout
    values = project.wait_done("human")
    decisions = {d["proposal_id"]: d for d in values["decisions"]}
    assert (decisions["r1-1"]["verdict"], decisions["r1-1"]["by"], decisions["r1-1"]["reason"]) == \
        ("vetoed", "ada", "baseline is known")
    assert (decisions["r1-2"]["verdict"], decisions["r1-2"]["by"]) == ("approved", "bob")
    assert [x["key"] for x in values["launches"]] == ["r1-2-s0"]
    history = project.cli("history", "human").stdout
    assert "ada" in history and "baseline is known" in history and "worth a look" in history
    assert "verdicts against the baseline" in history and "inconclusive" in history  # r1-1, its baseline, was vetoed
    # The veto turned to an approval in the MLflow UI after the decision: recorded as ignored, changes nothing.
    client = MlflowClient(project.tracking_uri)
    vetoed = next(r for r in project.runs("human") if r.data.tags.get("swarmrl.proposal") == "r1-1"
                  and r.data.tags.get("swarmrl.kind") == "proposal").info.run_id
    client.set_tag(vetoed, "review.by", "mallory")
    client.set_tag(vetoed, "review.status", "approved")
    history = project.cli("history", "human").stdout
    row = next(line for line in history.splitlines() if "mallory" in line)
    assert "r1-1" in row and "approved (ignored)" in row and "after the decision" in row
    assert client.get_run(vetoed).data.tags["review.status"] == "vetoed"  # the decision's tags are back
    project.cli("report", "human")
    report = (project.studies / "human" / "report.md").read_text()
    assert "- r1-1: vetoed, then changed to `approved` by mallory at" in report
    values, _, _ = project.state("human")
    assert [(d["proposal_id"], d["verdict"]) for d in values["decisions"]] == [("r1-1", "vetoed"), ("r1-2", "approved")]
    assert [x["key"] for x in values["launches"]] == ["r1-2-s0"]


def test_broken_brief_fails_at_start_naming_field_and_line(project: Project) -> None:
    brief = write_brief(project.tmp)
    brief.write_text(brief.read_text().replace("direction: maximize", "direction: sideways"))
    done = project.cli("start", str(brief), "--name", "broken", check=False)
    assert done.returncode == 2
    assert "line 3: objective.direction" in done.stdout
    assert not (project.studies / "broken").exists()


KILL_POINTS = ["node:load_brief", "node:plan", "review.pending", "node:review", "node:prepare", "launch.intent",
               "launch.spawned", "node:monitor", "node:analyze", "node:decide", "node:report"]


def _drive(project: Project, name: str, brief: Path, targets: list[str]) -> dict:
    """Run the study through the crash driver, killing it at each target in turn, approving reviews."""
    pending = list(targets)
    for _ in range(60):
        target = pending[0] if pending else "-"
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("crash_driver.py")), str(project.studies),
                               name, str(brief), target], cwd=ROOT, env=project.env(), capture_output=True, text=True,
                              timeout=600)
        if done.returncode == -9:
            assert pending and target == pending[0], f"killed without a target: {done.stderr}"
            pending.pop(0)
        elif done.returncode == 3:
            project.cli("approve", name, "--all", "--by", "tester", "--reason", "ok", "--no-resume")
        elif done.returncode == 0:
            assert not pending, f"the study ended before reaching {pending}"
            values, nxt, _ = project.state(name)
            assert not nxt
            return values
        else:
            raise AssertionError(f"driver exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    raise AssertionError("the study did not finish")


def test_kill_9_in_every_node_loses_and_duplicates_nothing(project: Project) -> None:
    # Deterministic choices: with reward/mean, which arm wins a 2-step rung is noise, and the calm and
    # the killed study could rightly promote different arms. One round reaches every kill point.
    brief = write_brief(project.tmp, approval="human", rounds=1, **DETERMINISTIC)
    calm = _drive(project, "calm", brief, [])
    killed = _drive(project, "killed", brief, KILL_POINTS)
    assert lineage(killed) == lineage(calm)
    assert len(killed["decisions"]) == len(killed["proposals"])
    for study, values in (("calm", calm), ("killed", killed)):
        runs = project.runs(study)
        per_launch = Counter(r.data.tags["swarmrl.launch"] for r in runs if "swarmrl.launch" in r.data.tags)
        assert per_launch == Counter(x["key"] for x in values["launches"])
        assert (project.studies / study / "report.md").exists()
