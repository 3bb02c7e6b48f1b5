"""The live node's A/B (researcher/study/nodes/live.py, researcher/runs/live_swaps.py) without a core run.

A stand-in live server: `swarm swap --ab` records an A/B start, and the paired scores both versions
log at each step after it (`core.config.ab_metric`) are given. What is checked is what the study does
with them: the verdict pairs the versions by step in the brief's direction, a win is kept only when the
next window confirms it, each sandbox of a swap gets its own verdict, the loser drains (`swarm swap
--drain-version`: the old version when the new one is better and confirmed, else the new one), the
before/after window is only a picture, and `ab_steps` reads only steps after the swap where both logged.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from core.config import ab_metric
from researcher.evidence.ab import HAC
from researcher.records import Launch, Proposal, SwapSide
from researcher.runs.launcher import Launcher, LaunchTarget
from researcher.runs.live_swaps import LiveRun
from researcher.study.nodes.live import LiveNode
from tests.researcher.test_live_watch import (  # noqa: F401 (fixtures)
    RecordedMlflow,
    brief,
    launcher,
    live_process,
)

SWAP_STEP = 30


OLD, NEW = ab_metric("letters", "v1"), ab_metric("letters", "v2")


def _history(effect: float, seed: int = 0, later: float | None = None, sandbox: str = "letters"
             ) -> dict[str, list[tuple[int, float]]]:
    """A learning run: v1 alone up to the swap (its plain reward), then v1 and v2 side by side, both riding the
    curve (their paired scores), for two windows; `later`: the effect in the second window (default `effect`)."""
    rng = random.Random(seed)
    alone, old, new = [], [], []
    for t in range(1, SWAP_STEP + 22):
        shared = 0.05 * t + rng.gauss(0, 0.3)
        if t <= SWAP_STEP:
            alone.append((t, shared + rng.gauss(0, 0.1)))
            continue
        old.append((t, shared + rng.gauss(0, 0.1)))
        gain = effect if later is None or t <= SWAP_STEP + 10 else later
        new.append((t, shared + gain + rng.gauss(0, 0.1)))
    return {f"reward/{sandbox}/version/v1": alone, ab_metric(sandbox, "v1"): old, ab_metric(sandbox, "v2"): new}


RECORD = {"n": 1, "step": SWAP_STEP, "sandbox": "letters", "from_versions": ["v1"], "to_version": "v2", "ab": True,
          "to_spec": "/x/letters", "drained": []}


class _Runner:
    """LiveRun with `swarm swap` stood in for: the A/B start is RECORD, drains are noted."""

    def __init__(self, history):
        self.real = LiveRun.__new__(LiveRun)
        self.real.client = RecordedMlflow(history)
        self.drained: list[tuple[str, str]] = []
        self.windows: list[int | None] = []  # where each window read by ab_steps starts (None: at the swap)

    def wait_up(self, alive):
        pass

    def swap(self, proposal_id, commit, sandboxes, run_id):
        return [dict(RECORD, n=i + 1, sandbox=name) for i, name in enumerate(sandboxes)]

    def tag(self, run_id, record, proposal_id):
        pass

    def drain(self, sandbox, version, proposal_id):
        self.drained.append((sandbox, version))

    def ab_steps(self, *args, **kwargs):
        self.windows.append(kwargs.get("after"))
        return self.real.ab_steps(*args, **kwargs)

    def before(self, *args):
        return self.real.before(*args)

    def cost(self, *args):
        return self.real.cost(*args)


def _node(tmp_path: Path, runner: _Runner, direction: str, **sections) -> LiveNode:
    """The live node of a study whose brief has `sections`, its live run watched by the real launcher."""
    node = LiveNode.__new__(LiveNode)
    target = LaunchTarget(command=["swarm", "run"], workdir=tmp_path, tracking_uri="sqlite:///unused.db",
                          experiment="study-x", study="x")
    node.ctx = SimpleNamespace(brief=brief(objective={"metric": "reward/mean", "direction": direction},
                                           run={"base_config": "base.yaml", "live": True, "swap_window": 10},
                                           launch={"run_timeout": 5.0}, **sections),
                               emit=lambda *a, **k: None, client=runner.real.client,
                               launcher=Launcher(target, tmp_path / "state", grace_s=10, emit=lambda *a, **k: None))
    node._live_run = lambda: runner
    return node


@pytest.fixture
def live(tmp_path: Path) -> Launch:
    config = tmp_path / "live.yaml"
    config.write_text(yaml.safe_dump({"clients": [{"agent": str(tmp_path / "code/sandboxes/letters")}]}))
    return Launch(key="live", proposal_id="live", seed=0, steps=1000, status="running", config_path=str(config),
                  run_id="run")


def _proposal() -> Proposal:
    return Proposal(id="p1", round=1, planner="manual", hypothesis="a shorter reply", rationale="shorter replies score more",
                    expected_effect="a higher reward", mode="hot_swap",
                    patch="--- a/sandboxes/letters/agent.py\n")


@pytest.mark.parametrize("effect, direction, result, loser", [
    (0.5, "maximize", "better", "v1"),  # the new version wins: the old one drains
    (0.0, "maximize", "inconclusive", "v2"),  # a null rides the curve: the old code is kept
    (0.5, "minimize", "worse", "v2"),  # higher reward is worse when the brief minimizes
    (-0.5, "minimize", "better", "v1"),
])
def test_the_ab_verdict_pairs_steps_in_the_briefs_direction_and_the_loser_drains(
        tmp_path, live, effect, direction, result, loser):
    runner = _Runner(_history(effect))
    [swap], _ = _node(tmp_path, runner, direction)._swap(_proposal(), "c0ffee", "a/sandboxes/letters/agent.py", live,
                                                        {}, 0, {})
    assert swap.verdict is not None and swap.verdict.result == result, swap.verdict.fmt()
    assert swap.verdict.test == HAC and swap.verdict.n == 10
    if result == "better":  # kept only once the next ten steps, which the verdict never saw, show it again
        assert swap.confirmation.result == "better" and swap.confirmation.n == 10
        assert runner.windows == [None, SWAP_STEP + 10]  # the confirmation reads from the first window's last step
    else:
        assert swap.confirmation is None
    assert runner.drained == [("letters", loser)]
    assert swap.kept == ("v2" if loser == "v1" else "v1")
    assert sorted(swap.after.steps) == sorted(swap.old.steps) == list(range(SWAP_STEP + 1, SWAP_STEP + 11))
    assert max(swap.before.steps) <= SWAP_STEP  # the picture: steps up to the swap, not part of the verdict


def test_a_win_the_next_window_does_not_show_is_not_kept(tmp_path, live):
    runner = _Runner(_history(0.5, later=0.0))  # a win over the first window only: not the code
    [swap], _ = _node(tmp_path, runner, "maximize")._swap(_proposal(), "c0ffee", "", live, {}, 0, {})
    assert swap.verdict.result == "better" and swap.confirmation.result == "inconclusive"
    assert swap.confirmation.reason.startswith("not confirmed on the next 10 steps")
    assert runner.drained == [("letters", "v2")] and swap.kept == "v1"


def test_each_sandbox_of_a_swap_gets_its_own_verdict(tmp_path, live):
    config = yaml.safe_load(Path(live.config_path).read_text())
    config["clients"].append({"agent": str(tmp_path / "code/sandboxes/roman")})
    Path(live.config_path).write_text(yaml.safe_dump(config))
    history = {**_history(0.5), **_history(-0.5, seed=3, sandbox="roman")}  # letters wins, roman loses
    runner = _Runner(history)
    node = _node(tmp_path, runner, "maximize")
    swaps, _ = node._swap(_proposal(), "c0ffee", "a/sandboxes/letters/x a/sandboxes/roman/y", live, {}, 0, {})
    assert [(s.sandbox, s.verdict.result, s.kept) for s in swaps] == [("letters", "better", "v2"),
                                                                        ("roman", "worse", "v1")]
    assert runner.drained == [("letters", "v1"), ("roman", "v2")]
    node.ctx.board = SimpleNamespace(close=lambda *args: None)  # the review board's run is not looked at here
    verdict = node._result(_proposal(), swaps).verdict  # the proposal is only as good as its weakest sandbox
    assert verdict.result == "worse" and verdict.reason == "sandbox roman: worse"


def test_a_rounds_other_comparisons_make_the_verdict_stricter(tmp_path, live):
    history = _history(0.06, seed=4)
    [alone], _ = _node(tmp_path, _Runner(history), "maximize")._swap(_proposal(), "c", "", live, {}, 0, {})
    [crowded], _ = _node(tmp_path, _Runner(history), "maximize")._swap(_proposal(), "c", "", live, {}, 4, {})
    alone, crowded = alone.verdict, crowded.verdict
    assert crowded.p_adjusted is not None and crowded.p_adjusted >= min(1.0, 5 * alone.p) - 1e-12


def test_ab_steps_reads_only_steps_after_the_swap_where_both_versions_logged():
    history = _history(0.0)
    history[NEW] = [(s, v) for s, v in history[NEW] if s % 2] + [
        (SWAP_STEP - 1, 9.0)]  # the new client served a little before the A/B was recorded
    runner = LiveRun.__new__(LiveRun)
    runner.client = RecordedMlflow(history)
    old, new, cut = runner.ab_steps("run", RECORD, 3, stopped=lambda: "the live run finished", timeout_s=0)
    assert isinstance(old, SwapSide) and sorted(old.steps) == sorted(new.steps) == [31, 33, 35] and cut is None
    assert (old.version, new.version) == ("v1", "v2")


LAST = SWAP_STEP + 4  # the live run got this far into the A/B's 10-step window


@pytest.mark.parametrize("trouble, sections, status, reason", [
    ("stall", {"monitor": {"stall_s": 30}}, "stalled", "the live run stalled: no new metric for "),
    ("nan", {}, "stopped", f"the live run was stopped: divergence: train/loss = nan at step {SWAP_STEP + 2}"),
    ("budget", {"budget": {"max_total_steps": LAST}}, "stopped",
     f"the live run was stopped: budget: {LAST} of {LAST} trainer steps used"),
])
def test_a_live_run_that_stalls_diverges_or_spends_the_budget_ends_the_ab_inconclusive_and_is_stopped(
        tmp_path, live, live_process, trouble, sections, status, reason):
    history = {k: [(s, v) for s, v in h if s <= LAST] for k, h in _history(2.0).items()}  # a big win, cut short
    history["reward/mean"] = history["reward/letters/version/v1"] + history[OLD]
    nan_at = SWAP_STEP + 2 if trouble == "nan" else None
    history["train/loss"] = [(s, math.nan if s == nan_at else 1.0) for s in range(1, LAST + 1)]
    now = time.time()
    # It logged its last step a minute ago (a stall of 60 s) or just now.
    seen = now - 60 if trouble == "stall" else now
    running = live.model_copy(update={"pid": live_process.pid, "started_at": now - 600, "steps_done": LAST,
                                      "progress_at": seen})
    runner = _Runner(history)
    [swap], after = _node(tmp_path, runner, "maximize", **sections)._swap(_proposal(), "c0ffee", "", running, {}, 0, {})
    assert swap.verdict is not None and swap.verdict.result == "inconclusive" and swap.verdict.test == "none"
    assert swap.verdict.reason.startswith(reason), swap.verdict.reason
    assert sorted(swap.after.steps) == list(range(SWAP_STEP + 1, LAST + 1))  # what it had, never judged
    assert runner.drained == [] and swap.kept is None  # a stopped run serves nothing to drain
    assert after.status == status and live_process.wait(timeout=30) is not None  # the study stopped it
    assert runner.real.client.terminated == ["KILLED"]  # and closed its MLflow run
