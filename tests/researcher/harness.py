"""Helpers for the researcher's integration tests: real CLI processes, real MLflow, real studies.

Studies run with the repository as their folder (so `configs/tiny.yaml` and `sandboxes/` resolve
as in `make demo`), while their state and MLflow store live in the test's temporary folder.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from researcher.study.runner import read_state
from researcher.study.store import study_paths

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SWARM = BIN / "swarm"

# A study brief that runs the real `swarm run` on the tiny config, kept as short as it can be.
TINY_BRIEF = """---
title: {title}
objective: {{metric: {metric}, direction: maximize}}
budget: {{max_runs: 8, max_rounds: {rounds}}}
run:
  base_config: configs/tiny.yaml
  overrides: {{trainer.steps: 4, trainer.batch_groups: 2}}
search_space:
  {space}
seeds: {seeds}
approval: {{config_only: {approval}}}
planner: {{seed: 0, heuristic: {{arms: 2, eta: 2, min_steps: 2}}}}
launch: {{concurrency: 2}}
monitor: {{poll_s: 0.5, collapse_drop: null}}
review: {{poll_s: 0.5}}
---
Integration test study.
"""


@functools.cache
def letters_code(smoke_episodes: int) -> str:
    """The brief lines of a code study of the letters agent (its reward read-only), smoke-tested on the tiny
    model: for the study tests that patch `sandboxes/letters/agent.py`."""
    return f"""search_space:
  agent: {{kind: code, paths: [sandboxes/letters/agent.py]}}
code:
  editable: [sandboxes/letters/]
  readonly: [sandboxes/letters/reward.py]
  smoke_model: tiny
  smoke_episodes: {smoke_episodes}
"""


# A study whose every choice is a function of its config, not of sampling noise: more groups per
# step log more samples, so two runs of it must propose, launch and decide the same things.
DETERMINISTIC = {"metric": "train/samples", "space": "trainer.batch_groups: {kind: choice, values: [2, 3]}"}


def write_brief(folder: Path, name: str = "brief", *, approval: str = "auto", rounds: int = 2,
                seeds: str = "[0]", title: str = "tiny test", metric: str = "reward/mean",
                space: str = "trainer.lr: {kind: choice, values: [0.0, 0.01]}") -> Path:
    path = folder / f"{name}.md"
    path.write_text(TINY_BRIEF.format(approval=approval, rounds=rounds, seeds=seeds, title=title, metric=metric,
                                      space=space))
    return path


@functools.cache
def warm_socket() -> str:
    """A `swarm warm` process for this test process's studies, started at the first one: their dozens of
    tiny `swarm run`s fork from it instead of importing torch, transformers and MLflow each (core.run.warm;
    ~6 of a 2-step run's ~8 s of CPU). tests/core/test_warm.py checks that a forked run is a cold one."""
    folder = Path(tempfile.mkdtemp(prefix="swarmrl-tests-warm-"))
    path, log = folder / "warm.sock", folder / "warm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(SWARM), "warm", "--socket", str(path)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    atexit.register(proc.terminate)  # after the folder's removal is registered: atexit runs last-in first-out
    deadline = time.monotonic() + 300
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"`swarm warm` did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return str(path)


@functools.cache
def empty_store() -> Path:
    """An MLflow SQLite store with its schema made, once per test process. Making the schema runs
    MLflow's migrations, ~3 s of CPU for each new store; a test's store starts as a copy of this one."""
    store = Path(tempfile.mkdtemp(prefix="mlflow-schema-")) / "mlflow.db"
    MlflowClient(f"sqlite:///{store}").search_experiments()
    return store


@dataclass
class Project:
    """A test's studies folder and MLflow store, with the repository as the working folder."""

    tmp: Path
    server: str | None = None  # a real `mlflow server`'s URL to use instead of the test's own SQLite file
    root: Path = ROOT  # the folder studies start in (configs/ and sandboxes/ resolve there): the repository

    def __post_init__(self) -> None:
        if self.server is None and not (self.tmp / "mlflow.db").exists():
            shutil.copyfile(empty_store(), self.tmp / "mlflow.db")

    @property
    def studies(self) -> Path:
        return self.tmp / "studies"

    @property
    def tracking_uri(self) -> str:
        return self.server or f"sqlite:///{self.tmp / 'mlflow.db'}"

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "MLFLOW_TRACKING_URI": self.tracking_uri, "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "200", "SWARMRL_WARM": warm_socket(), **extra}

    def cli(self, *args: str, timeout: float = 600, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        argv = [str(BIN / "researcher"), "study", "--studies-dir", str(self.studies), *args]
        done = subprocess.run(argv, cwd=self.root, env=self.env(**env), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def state(self, name: str) -> tuple[dict[str, Any], tuple[str, ...], list[str]]:
        return read_state(study_paths(self.studies, name), name)

    def wait_done(self, name: str, timeout: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            values, nxt, _ = self.state(name)
            if values and not nxt:
                return values
            time.sleep(1)
        raise AssertionError(f"study {name} did not finish in {timeout} s")

    def runs(self, study: str) -> list[Any]:
        client = MlflowClient(self.tracking_uri)
        exp = client.get_experiment_by_name(f"study-{study}")
        return client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL) if exp else []


def lineage(values: dict[str, Any]) -> dict[str, Any]:
    """What must be identical between an interrupted and an uninterrupted study."""
    return {"proposals": [(p["id"], p["overrides"]) for p in values.get("proposals", [])],
            "decisions": [(d["proposal_id"], d["verdict"], d["by"], d["source"]) for d in values.get("decisions", [])],
            "launches": [(x["key"], x["status"]) for x in values.get("launches", [])]}
