"""`swarm run` with `engine.kind: vllm` trains for real: SmolLM2-135M learns the oneword format.

The run is the user's command in its own process (`python -m core.run.cli run`), on
`configs/smollm2-oneword.yaml` shortened to a few steps; the reward curve is read back from MLflow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
# Measured with this engine (12-step run, stopped at 7): mean reward 0.09, 0.06 at steps 1-2, then
# 0.51, 0.45, 0.39, 0.61, 0.48; the hf engine's step-to-step noise is about 0.15 (docs/benchmarks.md).
# With overlap (max_staleness 1) the step at which it takes off depends on the machine's speed: run
# beside the other vLLM tests it was 0.11, 0.18, 0.16, 0.21, 0.41, 0.31 at steps 1-6, so the last
# three of eight steps are compared with the first two.
MIN_GAIN = 0.2
# trainer.seed now seeds vLLM's sampling and the task order, so a run's curve is (nearly) fixed by its
# seed instead of by luck. Measured here (2026-12-03): seed 0 0.06, 0.17, 0.39, 0.22, 0.28, 0.23, ...
# (gain 0.15: it plateaus in 8 steps), seed 1 0.10, 0.11, 0.45, 0.16, 0.47, 0.53, 0.47, 0.47 (gain
# 0.37), seed 2 0.16, 0.09, 0.55, 0.52, 0.37, 0.75, 0.72, 0.72 (gain 0.60). Seed 1, the middle one.
SEED = 1


@pytest.mark.timeout(1800)  # vLLM start-up plus eight SmolLM2 steps: minutes on 2 shared cores
def test_swarm_run_with_the_vllm_engine_learns_the_oneword_format(tmp_path):
    run_id_file = tmp_path / "run_id"
    cmd = [sys.executable, "-m", "core.run.cli", "run", str(ROOT / "configs" / "smollm2-oneword.yaml"), "--quiet",
           "--set", "engine.kind=vllm", "--set", f"trainer.steps={STEPS}", "--set", f"trainer.seed={SEED}",
           "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", "--experiment", "vllm-oneword",
           "--run-id-file", str(run_id_file)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient()
    run_id = run_id_file.read_text()
    assert client.get_run(run_id).info.status == "FINISHED"
    rewards = [m.value for m in sorted(client.get_metric_history(run_id, "reward/mean"), key=lambda m: m.step)]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > first + MIN_GAIN, rewards
