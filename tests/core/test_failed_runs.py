"""Failures never look like success, in real `swarm` processes with the tiny model: a run whose every
step is skipped for a non-finite loss ends FAILED, and `swarm serve --train` exits non-zero when its
run ends FAILED (a shell script or a supervisor reads the exit code, not the MLflow status).

`trainer.kl_coef=.inf` makes every loss non-finite without touching the code: k3 is 0 before the first
update, and inf * 0 is NaN, so each step is skipped and the weights (and generation) stay sound."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
EXIT_WAIT_S = 300.0  # start-up plus a few steps on a busy 2-core machine
NAN_LOSS = ("--set", "trainer.kl_coef=.inf", "--set", "trainer.max_failed_steps=2")


PERSON = "serve-person-token"  # the admin token of the `swarm serve` tests here, which their feeder opens with


def swarm(*args: str) -> list[str]:
    return [sys.executable, "-m", "core.run.cli", *args]


@pytest.mark.slow
def test_a_run_whose_every_step_is_skipped_ends_failed_with_a_non_zero_exit(tmp_path: Path):
    run_id_file = tmp_path / "run_id"
    done = subprocess.run(swarm("run", TINY, "--quiet", *NAN_LOSS, "--set", "trainer.steps=5",
                                "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
                                "--set", "telemetry.experiment=all-skipped", "--run-id-file", str(run_id_file)),
                          cwd=tmp_path, capture_output=True, text=True, timeout=EXIT_WAIT_S)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "2 train steps in a row failed or were skipped" in done.stderr
    run = MlflowClient().get_run(run_id_file.read_text())
    assert run.info.status == "FAILED"
    skipped = MlflowClient().get_metric_history(run.info.run_id, "train/skipped")
    assert [(m.step, m.value) for m in skipped] == [(1, 1.0), (2, 1.0)]  # stopped at the limit, not at step 5


@pytest.mark.slow
def test_swarm_serve_train_exits_non_zero_when_its_run_ends_failed(tmp_path: Path):
    # The feeder is a person's `swarm client`: it opens with the server's admin token (a training server takes
    # no anonymous opens), given here because a port-0 server is not in this machine's index.
    serve = subprocess.Popen(swarm("serve", TINY, *NAN_LOSS, "--set", "server.port=0", "--set", f"server.admin_token={PERSON}",
                                   "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
                                   "--set", "telemetry.experiment=serve-failed"),
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    feeder = None
    try:
        seen, url, deadline = [], None, time.monotonic() + EXIT_WAIT_S
        while url is None and time.monotonic() < deadline:
            line = serve.stdout.readline()
            assert line or serve.poll() is None, "".join(seen)[-3000:]
            seen.append(line)
            if found := re.search(r"serving .* at (http://\S+)", line):
                url = found.group(1)
        assert url is not None, "".join(seen)[-3000:]
        feeder = subprocess.Popen(swarm("client", "sandbox:letters", "--server", url), cwd=ROOT,
                                  env={**os.environ, "SWARMRL_ADMIN_TOKEN": PERSON},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out, _ = serve.communicate(timeout=EXIT_WAIT_S)
        out = "".join(seen) + out
    finally:
        for proc in (serve, feeder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert serve.returncode == 1, out[-3000:]
    assert "train steps in a row failed or were skipped" in out
    exp = MlflowClient().get_experiment_by_name("serve-failed")
    assert [r.info.status for r in MlflowClient().search_runs([exp.experiment_id])] == ["FAILED"]
