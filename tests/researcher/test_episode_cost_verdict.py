"""Calls and tokens per episode in every verdict (issue 38): each arm's cost, read from the core's `episode/calls` and
`episode/tokens`, stands beside the effect, so a harness that buys its score with more compute says so."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mlflow.tracking import MlflowClient

from researcher.brief.schema import CodeSpec, Objective
from researcher.code.workspace import Workspace
from researcher.evidence import analysis, baselines
from researcher.records import Cost, Launch, Proposal
from researcher.runs.launcher import Launcher, LaunchTarget
from researcher.runs.live_swaps import LiveRun

UP = Objective(metric="reward/mean", direction="maximize", window=1)
BASE = {"trainer.lr": 1.0e-5, "trainer.steps": 8}


def _arm(p: Proposal, scores: list[float], calls: float | None, tokens: float | None):
    launches = [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=8, status="finished") for s in range(3)]
    histories = {"episode/calls": [(1, calls), (2, calls)] if calls is not None else [],
                 "episode/tokens": [(1, tokens - 2), (2, tokens + 2)] if tokens is not None else []}
    outcomes = {x.key: replace(analysis.RunScore(v), cost=analysis.run_cost(histories)) for x, v in zip(launches, scores)}
    return analysis.experiment_result(p.id, launches, outcomes)


def test_a_verdict_shows_each_arms_calls_and_tokens_per_episode() -> None:
    resample = Proposal(id="r1-1", round=1, planner="person:ada", hypothesis="resample until good", rationale="r r",
                        expected_effect="e e", patch="--- a/x\n+++ b/x\n", overrides={"trainer.steps": 8})
    proposals = [resample, *baselines.needed([resample], [], [], BASE, 8, 1)]
    ref = proposals[-1]
    results = analysis.judge([_arm(resample, [0.38, 0.40, 0.39], 4.5, 54.0), _arm(ref, [0.13, 0.12, 0.14], 1.0, 12.0)],
                             proposals, BASE, 8, UP)
    verdict = results[0].verdict
    assert verdict is not None and verdict.result == "better"
    assert verdict.cost is not None and (verdict.cost.calls, verdict.cost.tokens) == (4.5, 54.0)
    assert verdict.cost_baseline is not None and verdict.cost_baseline.calls == 1.0
    assert verdict.fmt().endswith(f"per episode: 4.5 calls, 54 tokens vs 1 calls, 12 tokens ({ref.id})")
    assert results[0].cost is not None and results[0].cost.calls == 4.5  # the arm's own, for the report's row


def test_a_run_that_logged_no_cost_says_which_metrics_are_missing() -> None:
    p = Proposal(id="r1-1", round=1, planner="heuristic", hypothesis="h h", rationale="r r", expected_effect="e e",
                 overrides={"trainer.lr": 0.03, "trainer.steps": 8})
    proposals = [p, *baselines.needed([p], [], [], BASE, 8, 1)]
    results = analysis.judge([_arm(p, [1.0, 1.2, 1.1], None, None), _arm(proposals[-1], [0.0, 0.1, 0.05], 1.0, None)],
                             proposals, BASE, 8, UP)
    text = results[0].verdict.fmt()
    assert "per episode: not known vs 1 calls, tokens not logged" in text
    assert analysis.run_cost({"episode/calls": [], "episode/tokens": []}) is None
    assert Cost().fmt() == "not logged (episode/calls, episode/tokens)"


def test_an_ab_version_cost_is_read_from_the_cores_per_version_metrics(tmp_path: Path) -> None:
    """The live A/B's sides: `episode/<sandbox>/version/<v>/calls|tokens` over the window's steps only."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    run = client.create_run(client.create_experiment("live")).info.run_id
    for step, (calls, tokens) in {1: (9.0, 99.0), 2: (1.0, 12.0), 3: (1.0, 14.0)}.items():
        client.log_metric(run, "episode/letters/version/old/calls", calls, step=step)
        client.log_metric(run, "episode/letters/version/old/tokens", tokens, step=step)
    client.log_metric(run, "episode/letters/version/new/calls", 4.5, step=2)
    workspace = Workspace(tmp_path / "ws", CodeSpec(editable=["sandboxes/letters"]), tmp_path)
    live = LiveRun(Launcher(LaunchTarget(command=["swarm", "run"], workdir=tmp_path, tracking_uri="", experiment="e",
                                         study="s"), tmp_path / "state", 1, lambda *a, **k: None),
                   client, tmp_path / "state", workspace)
    assert live.cost(run, "letters", ["old"], {2: 0.1, 3: 0.1}) == Cost(calls=1.0, tokens=13.0)  # step 1 is outside
    assert live.cost(run, "letters", ["new"], {2: 0.3}) == Cost(calls=4.5, tokens=None)
    assert live.cost(run, "letters", ["gone"], {2: 0.3}) is None
