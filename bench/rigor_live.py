"""The in-run A/B on a real live run: a few null swaps into a tiny `swarm run`, judged by the study's code.

`bench/rigor.py --live-trials N` calls `trials`: one `swarm run` (tiny model, one isolated `letters`
client), then N times: a copy of the sandbox that changes nothing but its version (a comment) is
swapped in with `swarm swap --ab`, both versions' per-step rewards are read back from MLflow with the
study's reader (`LiveRun.ab_steps`), judged with `decision.judge_ab`, and the loser drained with
`swarm swap --drain-version`, as the live node does. Every swap but the last is null, so its `better`
would be a false keep; the last adds PLANTED to every reward (a real effect) and should be `better`.
A low learning rate keeps the run learning (a drifting reward) across the trials. It does not
simulate anything; the simulated A/B is in bench/rigor.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from mlflow.tracking import MlflowClient

from researcher.evidence import decision
from researcher.runs.live_swaps import LiveRun

ROOT = Path(__file__).resolve().parents[1]
SWARM = [sys.executable, "-m", "core.run.cli"]
PLANTED = 0.1  # added to every reward of the last trial's new version
LR = 3e-4  # the tiny model saturates the letters reward within ~150 steps at 3e-3; this keeps it learning


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def _copy(dest: Path, n: int, planted: float = 0.0) -> Path:
    """The letters sandbox with nothing changed but a comment (a new version, a null change), or with
    `planted` added to every reward."""
    folder = dest / f"v{n}" / "letters"
    shutil.copytree(ROOT / "sandboxes" / "letters", folder, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    agent = folder / "agent.py"
    agent.write_text(agent.read_text() + f"\n# null change {n}\n")
    if planted:
        scored = folder / "reward.py"
        scored.write_text(scored.read_text() + f"\n\n_unplanted = reward\n\n\ndef reward(text: str) -> float:\n"
                          f"    return _unplanted(text) + {planted}\n")
    return folder


def trials(count: int, window: int, direction: decision.Direction) -> list[tuple[bool, decision.Verdict]]:
    """`count` null A/B swaps and a planted one into one live tiny run; -> (planted, verdict) of each."""
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
    run = subprocess.Popen([*SWARM, "run", str(tmp / "run.yaml"), "--quiet", "--run-id-file", str(run_dir / "run_id")],
                           cwd=ROOT, env=env, stdout=open(tmp / "run.log", "wb"), stderr=subprocess.STDOUT)
    verdicts = []
    try:
        server = json.loads(_wait(lambda: (run_dir / "server.json").is_file() and (run_dir / "server.json").read_text(),
                                  300, "the live run's server"))

        def status() -> dict:
            return httpx.get(f"{server['url']}/swarm/v1/status", timeout=10).json()

        _wait(lambda: status()["models"]["policy"]["step"] >= 2, 300, "two steps")
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        run_id = (run_dir / "run_id").read_text().strip()
        reader = LiveRun(None, client, tmp / "state", None)  # type: ignore[arg-type] - only its MLflow reader is used
        for n in range(1, count + 2):
            started = time.monotonic()
            planted = PLANTED if n == count + 1 else 0.0
            spec = str(_copy(tmp, n, planted).resolve())
            out = subprocess.run([*SWARM, "swap", spec, "--server", str(run_dir), "--ab"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise RuntimeError(f"swarm swap --ab failed:\n{out.stderr[-2000:]}")
            record = next(r for r in reversed(status()["swaps"]) if r["ab"] and r["to_spec"] == spec)
            old, new = reader.ab_steps(run_id, record, window, alive=lambda: run.poll() is None, timeout_s=900)
            verdict = decision.judge_ab(new.steps, old.steps, direction, baseline_id=old.version)
            better = verdict.result == "better"
            for version in record["from_versions"] if better else [record["to_version"]]:
                subprocess.run([*SWARM, "swap", "letters", "--server", str(run_dir), "--drain-version", version],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
            _wait(lambda: len(status()["clients"]) == 1, 180, "the loser to leave")
            print(f"live A/B {n}{f' (planted +{planted})' if planted else ' (null)'}: swap at step {record['step']}, {len(new.steps)} paired steps, {verdict.fmt()} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            verdicts.append((bool(planted), verdict))
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
    return verdicts
