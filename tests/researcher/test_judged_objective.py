"""Only judged scores are decided on (issue 38, item 5): a study that edits code refuses, at brief load and naming
the line, an objective that is an agent's own number or averages in a sandbox no judge scores."""

from __future__ import annotations

from pathlib import Path

import pytest

from researcher.brief.schema import BriefError
from tests.researcher.helpers import brief_text, judged_sandbox
from researcher.brief.loader import parse_brief

SPACE = "  agent:\n    kind: code\n    paths: [sandboxes/toy/agent.py]"
CODE = "code:\n  editable: [sandboxes/toy/]"


def _project(tmp_path: Path, clients: list[str]) -> Path:
    toy = judged_sandbox(tmp_path / "sandboxes" / "toy")
    (toy / "agent.py").write_text("")
    shadow = tmp_path / "sandboxes" / "shadow"  # a sandbox without a judge: its agent's reward is its own number
    shadow.mkdir()
    (shadow / "agent.py").write_text("")
    listed = "".join(f"\n  - agent: {c}" for c in clients)
    (tmp_path / "base.yaml").write_text(f"trainer:\n  steps: 8\n  lr: 1.0e-5\nclients:{listed}\n")
    return tmp_path


def _load(workdir: Path, metric: str, code: str = CODE):
    return parse_brief(brief_text(SPACE, code, objective=metric), workdir=workdir)


@pytest.mark.parametrize("metric, why", [
    ("reward/mean", r"objective.metric: reward/mean would average in the rewards of sandbox:shadow, which no judge "
                    r"scores"),
    ("reward/shadow/mean", r"objective.metric: reward/shadow/mean: sandbox shadow is not a judged sandbox"),
    ("eval/shadow/mean", r"objective.metric: eval/shadow/mean: sandbox shadow is not a judged sandbox"),
    ("agent_reward/toy/mean", r"objective.metric: agent_reward/toy/mean is what agents report of themselves"),
    ("unjudged_reward/shadow/mean", r"objective.metric: unjudged_reward/shadow/mean is what agents report of themselves"),
])
def test_a_code_study_refuses_an_objective_no_judge_computes_at_brief_load(tmp_path: Path, metric: str,
                                                                          why: str) -> None:
    workdir = _project(tmp_path, ["sandbox:toy", "sandbox:shadow"])
    with pytest.raises(BriefError, match=r"line 4: " + why):
        _load(workdir, metric)


def test_a_code_study_decides_on_its_judged_sandboxes_scores(tmp_path: Path) -> None:
    workdir = _project(tmp_path, ["sandbox:toy", "sandbox:shadow"])
    assert _load(workdir, "reward/toy/mean").objective.metric == "reward/toy/mean"
    assert _load(workdir, "eval/toy/mean") is not None
    assert _load(workdir, "train/loss") is not None  # not an episode score: not the judge's to give
    only_judged = _project(tmp_path / "judged", ["sandbox:toy"])
    assert _load(only_judged, "reward/mean") is not None  # every client judged: the mean is the judges'


def test_a_study_that_edits_no_code_keeps_its_own_agents_rewards(tmp_path: Path) -> None:
    workdir = _project(tmp_path, ["sandbox:shadow"])
    brief = parse_brief(brief_text("  trainer.lr:\n    kind: choice\n    values: [0.03]", "", objective="reward/mean"),
                        workdir=workdir)
    assert brief.code is None and brief.objective.metric == "reward/mean"
