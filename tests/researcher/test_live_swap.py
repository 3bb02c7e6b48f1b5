"""Hot swap into a study's live run as an A/B, through the real CLI and real `swarm` processes (tiny model).

One `--planner manual` study with `run.live: true` keeps a `swarm run` going from the start. A
person proposes a patch with `--hot-swap` (shorter replies); it is validated, approved by an MLflow
tag, and swapped in with `swarm swap --ab`: the new client serves beside the old one. The researcher
is killed with -9 as soon as it has recorded the swap's intent, and resumed: the A/B starts once
(one A/B record on the server, one `swarmrl.swap.<n>` tag), the proposal's commit is made once, both
versions log paired scores at the same steps after the swap, the verdict pairs them by step, and the
loser drains (by a second record naming the winner) so one version serves on, with no episode lost.
`show --json` reports `swap: {step, old, new, steps, kept, verdict, ...}`. (That the new code's
reward is what trains is shown with a changed reward function in tests/core/test_swap.py; here the
reward file is read-only, as in a study.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from core.config import ab_metric
from researcher.study.store import owner_pid, study_paths
from tests.researcher.harness import Project, letters_code
from tests.researcher.test_code_study import AGENT, _approve_by_tag, _patch, _wait_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BRIEF = """---
title: live swap test
objective: {metric: reward/mean, direction: maximize}
budget: {max_runs: 2, max_rounds: 5}
run:
  base_config: configs/tiny.yaml
  overrides: {trainer.steps: 100000, trainer.batch_groups: 1, trainer.group_size: 2, engine.default_max_tokens: 8}
  live: true
  swap_window: 2
""" + letters_code(2) + """seeds: [0]
launch: {grace_s: 90}
monitor: {poll_s: 0.5, collapse_drop: null}
review: {poll_s: 0.5}
---
Does a constant reward show up as the new version's reward in the live run?
"""


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)


def _wait(predicate, timeout: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def _status(run_dir: Path) -> dict | None:
    try:
        info = json.loads((run_dir / "server.json").read_text())
        token = Path(info["admin_token_file"]).read_text().strip()  # other clients and the swaps: the admin's to read
        return httpx.get(f"{info['url']}/swarm/v1/status", headers={"Authorization": f"Bearer {token}"},
                         timeout=10).json()
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return None


def test_a_hot_swap_into_the_live_run_survives_kill_9_and_happens_once(project: Project) -> None:
    tmp = project.tmp
    brief = tmp / "live.md"
    brief.write_text(BRIEF)
    paths = study_paths(project.studies, "live")
    run_dir = paths.state / "runs" / "live"
    patch = _patch(tmp, "short", AGENT, "MAX_TOKENS = 12", "MAX_TOKENS = 4")
    project.cli("start", str(brief), "--name", "live", "--planner", "manual", "--detach")
    pids: set[int] = set()
    try:
        # The live run is going before anyone proposes, its sandbox an isolated, registered client.
        first = _wait(lambda: (s := _status(run_dir)) and s["models"]["policy"]["step"] >= 2 and s["clients"] and s,
                      600, "the live run to train", paths.log)
        [old] = first["clients"]
        pids.add(old["pid"])
        out = project.cli("propose", "live", "--patch", str(patch), "--hypothesis", "a constant reward", "--hot-swap")
        assert out.stdout.strip().splitlines()[-1] == "p1", out.stdout
        refused = project.cli("propose", "live", "--set", "trainer.lr=0.1", "--hypothesis", "no patch", "--hot-swap",
                              check=False)
        assert refused.returncode == 2 and "--hot-swap needs --patch" in refused.stdout
        view = _wait_status(project, "live", "p1", {"pending", "invalid"})
        assert view["status"] == "pending", view["validation"]["log"]
        _approve_by_tag(project, "live", "p1")
        intent = paths.state / "swaps" / "p1.json"
        _wait(intent.is_file, 300, "the swap's intent", paths.log)
        owner = owner_pid(paths)
        assert owner is not None and owner > 0
        os.kill(owner, signal.SIGKILL)  # mid-swap: `swarm swap` (its own session) goes on without us
        project.cli("resume", "live", "--detach")
        view = _wait_status(project, "live", "p1", {"done", "failed"})
        assert view["status"] == "done", view["result"]
        swap = view["swap"]
        assert set(swap) >= {"step", "old", "new", "steps", "kept", "verdict", "before"}
        assert isinstance(swap["old"], float) and isinstance(swap["new"], float) and len(swap["steps"]) == 2
        assert all(s > swap["step"] for s in swap["steps"])
        assert set(swap["verdict"]) == {"result", "test", "effect", "ci", "p"}

        now = _wait(lambda: (s := _status(run_dir)) and len(s["clients"]) == 1 and s, 180, "the loser to drain")
        [record, end] = now["swaps"]  # one A/B start, although the researcher died during it, then one drain
        assert record["ab"] is True and record["drained"] == [] and end["ab"] is False
        [serving] = now["clients"]
        pids.add(serving["pid"])
        assert serving["version"] == swap["kept"] and (serving["group_size"], serving["kind"]) == (2, "train")
        assert record["to_version"] != old["version"] and swap["step"] == record["step"]
        winner = record["to_version"] if swap["verdict"]["result"] == "better" else old["version"]
        assert swap["kept"] == winner and end["to_version"] == winner  # the loser drained, the winner its successor
        counters = now["episodes"]
        assert counters["aborted"] == 0 and counters["expired"] == 0  # the drain lost no episode

        run_id = (run_dir / "run_id").read_text().strip()
        client = MlflowClient(project.tracking_uri)
        tags = client.get_run(run_id).data.tags
        assert sorted(k for k in tags if k.startswith("swarmrl.swap.")) == [f"swarmrl.swap.{record['n']}"]
        assert json.loads(tags[f"swarmrl.swap.{record['n']}"]) == {
            "step": record["step"], "from_version": old["version"], "to_version": record["to_version"], "proposal": "p1"}
        for version in (old["version"], record["to_version"]):
            trained = {m.step for m in client.get_metric_history(run_id, f"reward/letters/version/{version}")}
            assert any(s > swap["step"] for s in trained), version  # both versions trained during the A/B
            # The A/B's steps are those at which a (task, weights) cell both versions reached was scored
            # (core.episodes.pairing): each version's paired score is logged there, whichever version trained.
            paired = {m.step for m in client.get_metric_history(run_id, ab_metric("letters", version))}
            assert set(swap["steps"]) <= paired, version

        git = ["git", "-C", str(paths.workspace)]
        refs = subprocess.run([*git, "for-each-ref", "--format=%(refname)", "refs/proposals/"], capture_output=True,
                              text=True).stdout.split()
        assert refs == ["refs/proposals/p1"]  # committed once
        assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout == ""
    finally:
        project.cli("stop", "live", "--kill-runs", check=False)
        for pid in pids:  # the live run drains its clients as it stops; none may be left behind
            _wait(lambda: not _alive(pid), 120, f"client {pid} to exit")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.split()[2] != "Z"
