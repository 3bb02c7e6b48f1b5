"""Done means: a manual study given two patches by a person, started from 3 seeds, recommends the one with a
real effect, confirmed at its commit after adding held-out seeds.

The letters sandbox is judged (its `judge.py` scores what the server recorded), so a real effect must change
what the agent sends. The study's project is a copy of the repository's tiny config and letters sandbox with
the agent handicapped (replies cut to one token: reward/mean ~0.01 instead of ~0.1); one patch restores it
(the real fix), the other changes a comment. Real `researcher` and `swarm run` processes on the tiny model.
The baseline rule gives the person's proposals their baseline; the fix is judged better (on 3 seeds it may be
inconclusive, p ~ 0.07: then the search adds seeds in a stage first); its confirmation on 3 held-out seeds is a
group-sequential test (O'Brien–Fleming spending over the looks the budget left pays for: its first look needs
p < 0.006 at most, out of reach of 3 seeds), so the study adds held-out seeds and decides at a later look; it
runs at the patch's own commit (its runs tagged with that commit,
`swarmrl.sandbox_version`) and is recommended by commit, the report showing each look; the comment is not
called better.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from researcher.study.store import study_paths
from tests.researcher.harness import ROOT, Project, letters_code
from tests.researcher.test_code_study import AGENT, _core_run_tags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

BRIEF = """---
title: planted code effect
objective: {metric: reward/mean, direction: maximize, window: 2}
budget: {max_runs: 33, max_rounds: 1}
run:
  base_config: configs/tiny.yaml
  overrides: {trainer.steps: 2, trainer.batch_groups: 1}
""" + letters_code(2) + """seeds: [0, 1, 2]
approval: {config_only: auto, code_change: auto}
launch: {concurrency: 2}
monitor: {poll_s: 0.5, collapse_drop: null}
review: {poll_s: 0.5}
---
Does either patch raise the letters reward?
"""
WHOLE = "MAX_TOKENS = 12"
HANDICAP = "MAX_TOKENS = 1  # replies cut to one token"


def _project(tmp: Path) -> Path:
    """A project folder: the tiny config and the letters sandbox, its agent handicapped."""
    root = tmp / "project"
    (root / "configs").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "tiny.yaml", root / "configs" / "tiny.yaml")
    shutil.copytree(ROOT / "sandboxes" / "letters", root / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    agent = root / AGENT
    assert WHOLE in agent.read_text()
    agent.write_text(agent.read_text().replace(WHOLE, HANDICAP))
    return root


def _patch(root: Path, tmp: Path, name: str, old: str, new: str) -> Path:
    """A unified diff, as `git diff` writes it, changing `old` to `new` in the project's agent."""
    repo = tmp / f"patch-{name}"
    shutil.copytree(root / "sandboxes", repo / "sandboxes")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    agent = repo / AGENT
    agent.write_text(agent.read_text().replace(old, new))
    diff = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout
    assert diff, f"{old!r} not found"
    out = tmp / f"{name}.diff"
    out.write_text(diff)
    return out


def _wait_for(path: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, path.read_text()[-2000:] if path.exists() else f"no {path}"
        time.sleep(0.3)


def test_a_manual_study_recommends_the_patch_with_a_real_effect_confirmed_at_its_commit(tmp_path: Path) -> None:
    root = _project(tmp_path)
    project = Project(tmp_path, root=root)
    brief = tmp_path / "planted.md"
    brief.write_text(BRIEF)
    big = _patch(root, tmp_path, "big", HANDICAP, WHOLE)
    null = _patch(root, tmp_path, "null", "EVAL_TEMPERATURE = 1.0", "EVAL_TEMPERATURE = 1.0  # unchanged")
    # Both proposals must land in the same round: the study waits for people, is stopped, given both, resumed.
    project.cli("start", str(brief), "--name", "planted", "--planner", "manual", "--detach")
    paths = study_paths(project.studies, "planted")
    _wait_for(paths.log, "waiting for proposals")
    project.cli("stop", "planted")
    for patch, what in ((big, "whole replies again"), (null, "a comment")):
        project.cli("propose", "planted", "--patch", str(patch), "--hypothesis", what, "--by", "ada")
    project.cli("resume", "planted", timeout=1500)

    values, nxt, _ = project.state("planted")
    assert not nxt, paths.log.read_text()[-3000:]
    proposals = {p["id"]: p for p in values["proposals"]}
    results = {r["proposal_id"]: r for r in values["results"]}
    commits = {v["proposal_id"]: v["commit"] for v in values["code"]}
    base = subprocess.run(["git", "-C", str(paths.workspace), "rev-parse", "base"], capture_output=True,
                          text=True, check=True).stdout.strip()
    # The baseline rule: the manual round got its baseline, at the base commit.
    baselines = [p for p in proposals.values() if p["planner"] == "baseline"]
    assert len(baselines) == 1 and baselines[0]["round"] == 1
    assert {t["swarmrl.sandbox_version"] for t in _core_run_tags(project, "planted", baselines[0]["id"])} == {base}
    scores = {k: (r["verdict"], r["seed_scores"]) for k, r in results.items()}
    assert results["p1"]["verdict"]["result"] == "better", scores  # at its first look, or after a search stage
    assert results["p2"]["verdict"]["result"] != "better", scores
    searched = {s for p in proposals.values() if not p["confirms"] for s in p["seeds"] or [0, 1, 2]}
    # Confirmed on held-out seeds at p1's own commit, against the baseline at the base commit, in looks planned
    # from the budget left when it started; the first (3 seeds per arm) cannot decide, so seeds were added.
    confirm = [p for p in proposals.values() if p["confirms"] == "p1"]
    picks = sorted((p for p in confirm if p["commit"]), key=lambda p: p["stage"])
    references = sorted((p for p in confirm if not p["commit"]), key=lambda p: p["stage"])
    assert [p["stage"] for p in picks] == [p["stage"] for p in references] == list(range(1, len(picks) + 1))
    assert len(picks) >= 2, scores
    looks = picks[0]["looks"]
    assert looks[0] == 3 and len(looks) >= 2 and all(p["looks"] == looks for p in confirm)
    for pick, reference in zip(picks, references):
        assert pick["seeds"] == reference["seeds"] and not set(pick["seeds"]) & searched  # held out, paired
        assert pick["commit"] == commits["p1"] and reference["reference"]
        pick_tags = _core_run_tags(project, "planted", pick["id"])
        assert len(pick_tags) == 3 and {t["swarmrl.sandbox_version"] for t in pick_tags} == {commits["p1"]}
        assert {t["swarmrl.sandbox_version"] for t in _core_run_tags(project, "planted", reference["id"])} == {base}
    assert all(p["planner"] == "replication" for p in picks[1:])
    confirmed = results["p1"]["confirmation"]
    assert confirmed["replicated"] is True, scores
    stages = confirmed["stages"]
    assert [v["look"] for v in stages] == list(range(1, len(picks) + 1))
    assert stages[0]["result"] == "inconclusive" and stages[0]["level"] < 0.01 and stages[-1]["result"] == "better"
    assert stages[-1]["n"] == 3 * len(stages) and stages[-1]["p"] < stages[-1]["level"]
    assert f"recommend p1 (code at commit {commits['p1']})" in values["stop_reason"]
    # The recommended code, written out and in the report.
    out = tmp_path / "recommended"
    project.cli("checkout", "planted", "--recommended", str(out))
    assert WHOLE in (out / AGENT).read_text() and HANDICAP not in (out / AGENT).read_text()
    report = (paths.root / "report.md").read_text()
    assert "## Recommended code" in report and commits["p1"] in report and f"+{WHOLE}" in report
    assert "## Seeds added in stages" in report and f"| p1 | confirmation | 1 of {len(looks)} |" in report
