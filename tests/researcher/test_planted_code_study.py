"""Done means: a manual study given two patches by a person, started from 3 seeds, recommends the one with a
real effect, confirmed at its commit after adding held-out seeds.

One patch has a large, real effect on the objective (the agent scores bytes the model cannot mean as
text as filler letters: reward/mean goes from ~0.1 to ~0.75), the other changes nothing (a comment).
Real `researcher` and `swarm run` processes on the tiny model and the letters sandbox. The study's
baseline rule gives the person's proposals their baseline; the first patch is judged better, its
confirmation on 3 held-out seeds is a group-sequential test (O'Brien–Fleming spending over the 3 looks the
budget pays for: its first look needs p < 0.0007, out of reach of 3 seeds), so the study adds held-out seeds
in a stage and decides at the second look; it runs at the patch's own commit (its confirmation runs tagged
with that commit, `swarmrl.sandbox_version`), and is recommended by commit, the report showing each look;
the second patch is not called better.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from researcher.study.store import study_paths
from tests.researcher.harness import Project, letters_code
from tests.researcher.test_code_study import AGENT, _core_run_tags, _patch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BRIEF = """---
title: planted code effect
objective: {metric: reward/mean, direction: maximize, window: 2}
budget: {max_runs: 27, max_rounds: 1}
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
SCORE = '    return reward(reply.choices[0].message.content or "")'
FILLER = ('    text = reply.choices[0].message.content or ""\n'
          '    # bytes the model cannot mean as text count as filler letters; case is normalised\n'
          '    return reward("".join(c if c.isascii() and c.isprintable() else "x" for c in text).lower())')


def _wait_for(path: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, path.read_text()[-2000:] if path.exists() else f"no {path}"
        time.sleep(0.3)


def test_a_manual_study_recommends_the_patch_with_a_real_effect_confirmed_at_its_commit(tmp_path: Path) -> None:
    project = Project(tmp_path)
    brief = tmp_path / "planted.md"
    brief.write_text(BRIEF)
    big = _patch(tmp_path, "big", AGENT, SCORE, FILLER)
    null = _patch(tmp_path, "null", AGENT, "MAX_TOKENS = 12", "MAX_TOKENS = 12  # unchanged")
    # Both proposals must land in the same round: the study waits for people, is stopped, given both, resumed.
    project.cli("start", str(brief), "--name", "planted", "--planner", "manual", "--detach")
    paths = study_paths(project.studies, "planted")
    _wait_for(paths.log, "waiting for proposals")
    project.cli("stop", "planted")
    for patch, what in ((big, "filler letters"), (null, "a comment")):
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
    assert results["p1"]["verdict"]["result"] == "better", scores
    assert results["p2"]["verdict"]["result"] != "better", scores
    # Confirmed on held-out seeds at p1's own commit, against the baseline at the base commit, in looks: the
    # budget left after the search (18 runs) pays for 3 looks of 3 seeds per arm; look 1 cannot decide.
    confirm = [p for p in proposals.values() if p["confirms"] == "p1"]
    picks = sorted((p for p in confirm if p["commit"]), key=lambda p: p["stage"])
    references = sorted((p for p in confirm if not p["commit"]), key=lambda p: p["stage"])
    assert [p["stage"] for p in picks] == [p["stage"] for p in references] and len(picks) >= 2, scores
    assert all(p["looks"] == [3, 6, 9] for p in confirm)
    assert picks[0]["seeds"] == references[0]["seeds"] == [3, 4, 5]
    assert picks[1]["seeds"] == references[1]["seeds"] == [6, 7, 8] and picks[1]["planner"] == "replication"
    for pick, reference in zip(picks, references):
        assert pick["commit"] == commits["p1"] and reference["reference"]
        pick_tags = _core_run_tags(project, "planted", pick["id"])
        assert len(pick_tags) == 3 and {t["swarmrl.sandbox_version"] for t in pick_tags} == {commits["p1"]}
        assert {t["swarmrl.sandbox_version"] for t in _core_run_tags(project, "planted", reference["id"])} == {base}
    confirmed = results["p1"]["confirmation"]
    assert confirmed["replicated"] is True, scores
    looks = confirmed["stages"]
    assert looks[0]["result"] == "inconclusive" and looks[0]["level"] < 0.001 and looks[-1]["result"] == "better"
    assert confirmed["seeds"][:6] == [3, 4, 5, 6, 7, 8] and looks[-1]["n"] == 3 * len(looks)
    assert f"recommend p1 (code at commit {commits['p1']})" in values["stop_reason"]
    # The recommended code, written out and in the report.
    out = tmp_path / "recommended"
    project.cli("checkout", "planted", "--recommended", str(out))
    assert 'else "x" for c in text' in (out / AGENT).read_text()
    report = (paths.root / "report.md").read_text()
    assert "## Recommended code" in report and commits["p1"] in report and '+    text = reply.choices' in report
    assert "## Seeds added in stages" in report and "| p1 | confirmation | 1 of 3 |" in report
