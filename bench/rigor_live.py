"""The in-run A/B on a real live run: null swaps into a tiny `swarm run`, judged by the study's code.

`bench/rigor.py` calls `trials` (5 null swaps by default; `--live-trials`), and so does
`python bench/rigor_live.py --trials N --window W --json OUT` (tests/researcher/test_live_ab_real.py).
One `swarm run` (tiny model, one isolated `letters` client), then N times: a copy of the sandbox that
changes nothing but its version (a comment) is swapped in with `swarm swap --ab`. The core pairs the
two versions (`core.episodes.pairing`: the new client runs the tasks the old one opens, groups are
per version, scores compared only on the same task and weights); both versions' per-step paired
scores are read back from MLflow with the study's reader (`LiveRun.ab_steps`), judged with
`researcher.evidence.ab.judge_ab`, a `better` confirmed on the next window (`confirm_ab`), and the
loser drained with `swarm swap --drain-version`, as the live node does. Every swap is null, so
keeping its new version is a false keep. (A planted swap would need a change in what the agent does:
`letters` is judged, so a patch of its own reward file moves only its logged `agent_reward`; detection
is measured on simulated runs, bench/rigor_ab.py.) Each trial also records the evidence that the comparison was one of code alone: the
server's latest compared pairs (each with its episodes' task and weights), and per judged step the
groups that mixed versions and the versions that trained. A low learning rate keeps the run learning
(a drifting reward) across the trials. It does not simulate anything; the simulated A/B is bench/rigor_ab.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the project's packages import from its root

from researcher.evidence import ab, decision
from researcher.evidence.analysis import read_history
from researcher.runs.live_swaps import LiveRun

SWARM = [sys.executable, "-m", "core.run.cli"]
LR = 3e-4  # the tiny model saturates the letters reward within ~150 steps at 3e-3; this keeps it learning
TRIALS = 5  # null swaps in bench/rigor.py's default invocation
WINDOW_TIMEOUT_S = 900.0  # a window of paired steps on a busy 2-core machine: generous, a stall still ends


@dataclass
class Trial:
    to_version: str  # the new version: keeping it after a null swap is a false keep
    swap_step: int | None
    steps: list[int]  # the judged window's steps (both versions logged a paired score)
    verdict: dict
    confirmation: dict | None
    kept: str
    pairs: list[dict] = field(default_factory=list)  # the server's latest compared pairs (core.episodes.pairing)
    mixed_groups: dict[int, float] = field(default_factory=dict)  # judged step -> groups that mixed versions
    trained_versions: dict[int, list[str]] = field(default_factory=dict)  # judged step -> versions that trained


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def _copy(dest: Path, n: int) -> Path:
    """The letters sandbox with nothing changed but a comment: a new version, a null change."""
    folder = dest / f"v{n}" / "letters"
    shutil.copytree(ROOT / "sandboxes" / "letters", folder, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    agent = folder / "agent.py"
    agent.write_text(agent.read_text() + f"\n# null change {n}\n")
    return folder


def _evidence(client: MlflowClient, run_id: str, record: dict, steps: list[int]) -> tuple[dict, dict]:
    """Per judged step: groups that mixed code versions, and the versions whose episodes trained."""
    mixed = {s: v for s, v in read_history(client, run_id, "episodes/mixed_version_groups") if s in steps}
    trained: dict[int, list[str]] = {}
    for version in [*record["from_versions"], record["to_version"]]:
        for s, v in read_history(client, run_id, f"episodes/{record['sandbox']}/version/{version}"):
            if s in steps and v > 0:
                trained.setdefault(s, []).append(version)
    return mixed, trained


def trials(count: int, window: int, direction: decision.Direction) -> list[Trial]:
    """`count` null A/B swaps into one live tiny run, one after the other; -> each trial."""
    tmp = Path(tempfile.mkdtemp(prefix="rigor-live-"))
    run_dir = tmp / "run"
    config = {"models": [{"name": "policy", "source": "tiny"}], "engine": {"max_batch": 16, "default_max_tokens": 8},
              "server": {"port": 0},
              "trainer": {"steps": 100_000, "batch_groups": 2, "group_size": 4, "lr": LR,
                          "checkpoint_dir": str(run_dir / "checkpoints"), "checkpoint_every": 0},
              "clients": [{"agent": str(_copy(tmp, 0)), "isolate": True, "group_size": 2, "concurrency": 4}],
              "telemetry": {"experiment": "rigor-live", "trajectories_per_step": 0}}
    (tmp / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "SWARMRL_STATE": str(tmp / "state"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    with open(tmp / "run.log", "wb") as run_log:  # the child keeps its own copy of the descriptor
        run = subprocess.Popen([*SWARM, "run", str(tmp / "run.yaml"), "--quiet", "--run-id-file",
                                str(run_dir / "run_id")], cwd=ROOT, env=env, stdout=run_log, stderr=subprocess.STDOUT)
    out: list[Trial] = []
    try:
        server = json.loads(_wait(lambda: (run_dir / "server.json").is_file() and (run_dir / "server.json").read_text(),
                                  300, "the live run's server"))

        def status() -> dict:
            token = Path(server["admin_token_file"]).read_text().strip()  # the swaps and clients: the admin's to read
            return httpx.get(f"{server['url']}/swarm/v1/status", headers={"Authorization": f"Bearer {token}"},
                             timeout=10).json()

        def stopped() -> str | None:
            return None if run.poll() is None else f"the live run exited ({run.returncode}); see {tmp / 'run.log'}"

        _wait(lambda: status()["models"]["policy"]["step"] >= 2, 300, "two steps")
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        run_id = (run_dir / "run_id").read_text().strip()
        reader = LiveRun(None, client, tmp / "state", None)  # type: ignore[arg-type] - only its MLflow reader is used
        for n in range(1, count + 1):
            started = time.monotonic()
            spec = str(_copy(tmp, n).resolve())
            swapped = subprocess.run([*SWARM, "swap", spec, "--server", str(run_dir), "--ab"], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=600, check=False)
            if swapped.returncode != 0:
                raise RuntimeError(f"swarm swap --ab failed:\n{swapped.stderr[-2000:]}")
            record = next(r for r in reversed(status()["swaps"]) if r["ab"] and r["to_spec"] == spec)
            old, new, cut = reader.ab_steps(run_id, record, window, stopped, WINDOW_TIMEOUT_S)
            if cut is not None:
                raise RuntimeError(f"the A/B's window did not fill: {cut}")
            verdict = ab.judge_ab(new.steps, old.steps, direction, baseline_id=old.version)
            confirmation = None
            if verdict.result == "better":
                old2, new2, cut = reader.ab_steps(run_id, record, window, stopped, WINDOW_TIMEOUT_S,
                                                  after=max(new.steps))
                if cut is not None:
                    raise RuntimeError(f"the confirmation's window did not fill: {cut}")
                confirmation = ab.confirm_ab(verdict, new2.steps, old2.steps, direction, baseline_id=old2.version)
            better = confirmation is not None and confirmation.result == "better"
            pairs = status()["ab"]["pairs"]
            for version in record["from_versions"] if better else [record["to_version"]]:
                subprocess.run([*SWARM, "swap", "letters", "--server", str(run_dir), "--drain-version", version],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
            _wait(lambda: len(status()["clients"]) == 1, 180, "the loser to leave")
            steps = sorted(new.steps)
            mixed, trained = _evidence(client, run_id, record, steps)
            trial = Trial(to_version=record["to_version"], swap_step=record["step"], steps=steps, verdict=verdict.json_view(),
                          confirmation=confirmation.json_view() if confirmation else None,
                          kept=record["to_version"] if better else ",".join(record["from_versions"]), pairs=pairs,
                          mixed_groups=mixed, trained_versions=trained)
            print(f"live A/B {n} (null): swap at step {record['step']}, "
                  f"{len(steps)} paired steps, {verdict.fmt()}"
                  f"{f'; confirmation {confirmation.fmt()}' if confirmation else ''}; kept {trial.kept} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            out.append(trial)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(timeout=120)
            except subprocess.TimeoutExpired:
                run.kill()
        for pid_file in (tmp / "state").glob("*.pid"):  # clients swap started outlive nothing: stop any left
            pid = json.loads(pid_file.read_text())["pid"]
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=TRIALS, help="null swaps, one after the other")
    ap.add_argument("--window", type=int, default=10, help="paired steps per A/B window (the brief's swap_window)")
    ap.add_argument("--json", type=Path, help="write every trial, with its pairing evidence, here")
    args = ap.parse_args()
    done = trials(args.trials, args.window, "maximize")
    if args.json:
        args.json.write_text(json.dumps([asdict(t) for t in done], indent=1))
    print(summary(done))


def summary(done: list[Trial]) -> str:
    """One line: the null swaps, how many were called better and how many kept (false keeps)."""
    return (f"live A/B: {len(done)} real null swaps into a tiny run, {sum(t.verdict['result'] == 'better' for t in done)} "
            f"called better in the first window, {sum(t.kept == t.to_version for t in done)} kept")


if __name__ == "__main__":
    main()
