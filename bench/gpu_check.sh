#!/usr/bin/env bash
# The GPU check (issue 23), on the lent GPU image as it is: torch, transformers, peft, numpy and
# PyYAML are there; no package index, no vLLM, MLflow or FastAPI. The one missing package the
# engine and trainer import, pydantic (core.config, core.records), travels as wheels in .whl/
# (`make gpu-wheels` here, ~2.5 MiB), which this script installs into /tmp/site.
#
#   make gpu-wheels                                   (once, here: fills .whl/)
#   device run, carry [".whl"]:  bash bench/gpu_check.sh          (~ a few minutes on an H200)
#   bash bench/gpu_check.sh --small --device cpu      (a dry run of the whole check on a CPU)
#
# It prints one table per part (engine decode, trainer step and memory, 1.5B MFU) and a last line
# `gpu_check: decode_tok_s_b32=<x> train_step_s=<y> mfu=<z> peak_gib=<w>` (bench/gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "pydantic is missing and .whl/ holds no wheels: run 'make gpu-wheels' and carry .whl" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
exec "$PY" bench/gpu_check.py "$@"
