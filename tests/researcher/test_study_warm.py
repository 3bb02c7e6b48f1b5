"""A study started without `SWARMRL_WARM` runs a `swarm warm` of its own, in a folder of its state only this user
can enter, forks its core runs from it, and stops it when the study process ends. A real study of the tiny
model (one round, config only, approved by policy), started in the background from the CLI."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

from tests.researcher.harness import BIN, ROOT, empty_store, write_brief

NAME = "warm"
DEADLINE_S = 900  # the study's own warm process imports torch and MLflow once, on a loaded 2-core host


def _warm_processes(socket: Path) -> list[int]:
    """Live `swarm warm` processes whose command line names `socket`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"warm" in cmdline and str(socket).encode() in cmdline:
            found.append(int(entry.name))
    return found


def test_a_study_forks_its_runs_from_a_warm_process_of_its_own_and_stops_it(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"
    store.write_bytes(empty_store().read_bytes())
    brief = write_brief(tmp_path, rounds=1)
    env = {k: v for k, v in os.environ.items() if k != "SWARMRL_WARM"}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{store}", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cli = [str(BIN / "researcher"), "study", "--studies-dir", str(tmp_path / "studies")]
    subprocess.run([*cli, "start", str(brief), "--name", NAME, "--planner", "heuristic", "--detach"], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=300)
    state = tmp_path / "studies" / NAME / ".study"
    socket, log = state / "warm" / "warm.sock", state / "warm" / "warm.log"
    deadline = time.monotonic() + DEADLINE_S
    while not socket.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert socket.exists(), log.read_text() if log.exists() else "no warm log"
    assert stat.S_IMODE(socket.parent.stat().st_mode) == 0o700
    assert _warm_processes(socket)
    while (state / "study.pid").exists() and time.monotonic() < deadline:  # the study runs to its report
        time.sleep(2)
    assert not (state / "study.pid").exists(), (state / "study.log").read_text()[-3000:]
    assert "finished" in (state / "study.log").read_text()
    assert "forked pid" in log.read_text() and "`swarm run " in log.read_text(), log.read_text()
    gone = time.monotonic() + 30
    while _warm_processes(socket) and time.monotonic() < gone:
        time.sleep(0.5)
    assert not _warm_processes(socket) and not socket.exists()  # stopped with the study
