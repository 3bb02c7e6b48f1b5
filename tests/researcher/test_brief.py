"""The brief: valid briefs parse, broken ones name the field and the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from researcher.brief.loader import load_brief, parse_brief
from researcher.brief.schema import BriefError, ChoiceParam, CodeArea, RangeParam
from tests.researcher.helpers import judged_sandbox

ROOT = Path(__file__).resolve().parents[2]

GOOD = """---
title: test
objective:
  metric: reward/mean
  direction: maximize
budget:
  max_runs: 4
  wall_clock: 20m
run:
  base_config: base.yaml
search_space:
  trainer.lr:
    kind: range
    low: 1.0e-5
    high: 1.0e-2
    log: true
  trainer.kl_coef:
    kind: choice
    values: [0.0, 0.1]
  prompt:
    kind: code
    paths: [sandboxes/x/agent.py]
seeds: 3
---
# Background
Some words.
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "base.yaml").write_text("trainer:\n  steps: 6\n")
    return tmp_path


def test_valid_brief_parses_with_kinds_durations_and_seed_count(workdir: Path) -> None:
    brief = parse_brief(GOOD, workdir=workdir)
    assert brief.budget.wall_clock == 1200.0
    assert brief.seeds == [0, 1, 2]
    assert isinstance(brief.search_space["trainer.lr"], RangeParam)
    assert isinstance(brief.search_space["trainer.kl_coef"], ChoiceParam)
    assert isinstance(brief.search_space["prompt"], CodeArea)
    assert brief.body.startswith("# Background")
    assert brief.resolve_config(workdir, {"trainer.lr": 0.001}).trainer.lr == 0.001


@pytest.mark.parametrize("old, new, field, line", [
    ("  direction: maximize", "  direction: upward", "objective.direction", 5),
    ("  max_runs: 4", "  max_runs: 0", "budget.max_runs", 7),
    ("  wall_clock: 20m", "  wall_clock: soon", "budget.wall_clock", 8),
    ("    high: 1.0e-2", "    high: 1.0e-6", "search_space.trainer.lr", 12),
    ("seeds: 3", "seeds: [1, 1]", "seeds", 23),
    ("title: test", "title: test\ncolour: blue", "colour", 3),
])
def test_broken_brief_names_field_and_line(workdir: Path, old: str, new: str, field: str, line: int) -> None:
    with pytest.raises(BriefError) as err:
        parse_brief(GOOD.replace(old, new), workdir=workdir)
    assert field in str(err.value)
    assert f"line {line}:" in str(err.value)


def test_code_auto_approval_without_a_code_section_is_refused(workdir: Path) -> None:
    text = GOOD.replace("seeds: 3", "seeds: 3\napproval:\n  code_change: auto")
    with pytest.raises(BriefError, match=r"approval.code_change: auto .* no code: section"):
        parse_brief(text, workdir=workdir)


def test_code_section_paths_must_exist_and_readonly_lie_inside_editable(workdir: Path) -> None:
    judged_sandbox(workdir / "sandboxes" / "toy")
    (workdir / "sandboxes" / "toy" / "agent.py").write_text("")
    good = GOOD.replace("seeds: 3", "seeds: 3\ncode:\n  editable: [sandboxes/toy/]\n  readonly: [sandboxes/toy/agent.py]")
    assert parse_brief(good, workdir=workdir).code.editable == ["sandboxes/toy"]  # type: ignore[union-attr]
    with pytest.raises(BriefError, match=r"code.editable: sandboxes/gone does not exist"):
        parse_brief(good.replace("sandboxes/toy/]", "sandboxes/gone]").replace("sandboxes/toy/agent.py", "sandboxes/gone/a.py"),
                    workdir=workdir)
    with pytest.raises(BriefError, match=r"readonly path 'other.py' is not inside an editable path"):
        parse_brief(good.replace("readonly: [sandboxes/toy/agent.py]", "readonly: [other.py]"), workdir=workdir)
    with pytest.raises(BriefError, match=r"'\.\./x' must be a path relative to the project"):
        parse_brief(good.replace("[sandboxes/toy/]", "[../x, sandboxes/toy]"), workdir=workdir)


def test_search_key_unknown_to_the_run_config_is_named_with_its_line(workdir: Path) -> None:
    text = GOOD.replace("  trainer.kl_coef:", "  trainer.klcoef:")
    with pytest.raises(BriefError, match=r"line 17: search_space.trainer.klcoef: not a usable run config key"):
        parse_brief(text, workdir=workdir)


def test_missing_base_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BriefError, match=r"line \d+: run: the base config does not load: .*base.yaml does not exist"):
        parse_brief(GOOD, workdir=tmp_path)


def test_front_matter_problems_are_reported_with_lines() -> None:
    with pytest.raises(BriefError, match="line 1: a brief must start with '---'"):
        parse_brief("# no front matter\n")
    with pytest.raises(BriefError, match="not closed"):
        parse_brief("---\ntitle: x\n")
    with pytest.raises(BriefError, match=r"line 3: the front matter is not valid YAML"):
        parse_brief("---\ntitle: x\nobjective: {metric: a}}\n---\n")


@pytest.mark.parametrize("name", ["tiny-lr.md", "smollm2-guess.md"])
def test_shipped_briefs_are_valid(name: str) -> None:
    brief = load_brief(ROOT / "studies" / name)
    assert brief.search_space and brief.objective.metric == "reward/mean"


@pytest.mark.parametrize("name", ["tiny-code.md", "smollm2-oneword-code.md", "tiny-code-live.md"])
def test_shipped_code_briefs_keep_the_reward_read_only_and_need_a_person(name: str) -> None:
    brief = load_brief(ROOT / "studies" / name, workdir=ROOT)
    assert brief.code is not None and brief.approval.code_change == "human"
    assert brief.code.readonly and all((ROOT / path).is_file() for path in brief.code.readonly)


def test_shipped_tiny_brief_auto_approves_and_fits_its_budget() -> None:
    brief = load_brief(ROOT / "studies" / "tiny-lr.md")
    assert brief.approval.config_only == "auto"
    arms = brief.planner.heuristic.arms
    assert arms * len(brief.seeds) <= brief.budget.max_runs


@pytest.mark.parametrize("name, config", [("tiny-lr.md", "configs/tiny.yaml"),
                                          ("smollm2-guess.md", "configs/smollm2-guess.yaml"),
                                          ("tiny-code.md", "configs/tiny.yaml"),
                                          ("smollm2-oneword-code.md", "configs/smollm2-oneword.yaml")])
def test_shipped_briefs_match_the_core_config(name: str, config: str) -> None:
    if not (ROOT / config).is_file():
        pytest.skip(f"{config} is not written yet (the lead's)")
    load_brief(ROOT / "studies" / name, workdir=ROOT)
