"""The report's hot swaps: each drawn as a picture (old before, old and new after) beside its A/B verdict."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from researcher.brief.schema import Brief
from researcher.evidence.decision import Verdict
from researcher.records import SwapResult, SwapSide
from researcher.review.report import render
from researcher.study.store import study_paths


def _swap() -> SwapResult:
    return SwapResult(proposal_id="r2-1", n=1, step=30, sandbox="letters", from_version="v0aaaaaaaaaaaaa",
                      to_version="v1bbbbbbbbbbbbb", before=SwapSide(version="v0", steps={28: 0.1, 29: 0.2, 30: 0.2}),
                      old=SwapSide(version="v0", steps={31: 0.2, 32: 0.3}),
                      after=SwapSide(version="v1", steps={31: 0.6, 32: 0.7}),
                      verdict=Verdict(result="better", test="paired t-test", effect=0.4, ci=[0.2, 0.6], p=0.01, n=2,
                                      n_baseline=2, reason="A/B"), kept="v1bbbbbbbbbbbbb")


def test_each_hot_swap_gets_a_picture_and_its_ab_verdict_never_a_before_after_one(tmp_path) -> None:
    brief = Brief.model_validate({"objective": {"metric": "reward/mean"}, "run": {"base_config": "base.yaml"},
                                  "search_space": {"lr": {"kind": "choice", "values": [1e-5]}}})
    paths = study_paths(tmp_path / "studies", "s")
    paths.root.mkdir(parents=True)
    state = {"proposals": [], "launches": [], "results": [], "swaps": [_swap().model_dump()]}
    markdown = render("s", brief, state, MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"), paths, {})
    assert "## Hot swaps into the live run" in markdown
    assert "- swap 1, r2-1: v0aaaaaaaaaa -> v1bbbbbbbbbb at step 30: better" in markdown
    assert "kept v1bbbbbbbbbb" in markdown and "drawn for context only" in markdown
    picture = paths.figures / "swap-1.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"![swap 1]({picture.relative_to(paths.root).as_posix()})" in markdown


def test_a_study_without_hot_swaps_has_no_swap_section(tmp_path) -> None:
    brief = Brief.model_validate({"objective": {"metric": "reward/mean"}, "run": {"base_config": "base.yaml"},
                                  "search_space": {"lr": {"kind": "choice", "values": [1e-5]}}})
    paths = study_paths(tmp_path / "studies", "s")
    paths.root.mkdir(parents=True)
    markdown = render("s", brief, {"proposals": []}, MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"), paths, {})
    assert "Hot swaps" not in markdown and not list(paths.figures.glob("swap-*.png"))
