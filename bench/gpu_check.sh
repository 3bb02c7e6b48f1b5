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
# Not yet in it: vLLM replicas (vLLM is not on the image, and bench/replicas.py has no vLLM mode: the
# line `check vllm_replicas: skipped ...` says which). bench/fsdp2_check.py has run only as its CPU
# dry run (`--device cpu`: gloo, CPU replicas) so far; no GPU was lent since it was written.
#
# It prints one table per part (engine decode, trainer step and memory, 1.5B MFU) and the line
# `gpu_check: decode_tok_s_b32=<x> train_step_s=<y> mfu=<z> peak_gib=<w>` (bench/gpu_check.py), then
# the replicas figures (bench/replicas.py: rollout_scaling_2, train_scaling_2, sync_s) and an FSDP2
# step (bench/sharded_step.py) on a device with 2 or more GPUs, then `check <name>: ok|FAIL|skipped`
# lines: bench/many_devices.py (pinned, nccl_sync, hung_nccl, offload; peak GiB per GPU) and
# bench/fsdp2_check.py (fsdp2_resume: 2 NCCL ranks with KL, a DCP checkpoint resumed at world size 1
# and 2; fsdp2_stream: a replica sync streamed from the shards, stream_peak_mib below the model's
# size; colocated: 2 fsdp2 ranks and 2 sleeping replicas on their GPUs through 3 steps; vllm_replicas).
# On one GPU what needs two says skipped.
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
"$PY" bench/gpu_check.py "$@"
# One model on many GPUs (issue 33): rollout completions/s at 1 and 2 replicas, trainer step time at 1
# and 2 NCCL ranks, weight sync time; last line `replicas: rollout_scaling_2=.. train_scaling_2=.. sync_s=..`.
# It needs two GPUs (NCCL refuses two ranks on one); with fewer it says so and is skipped.
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  "$PY" bench/replicas.py --device cuda --completions 256 --concurrency 32 --max-tokens 128  # tiny: no download there
  # FSDP2 on NCCL (core/train/sharded.py): the gradient gathered from 2 shards vs one rank's, step times
  # at 1 rank, 2 fsdp2 and 2 replicated ranks; last line `sharded: grad_rel_diff=.. step_s_fsdp2_2=..`.
  "$PY" bench/sharded_step.py --device cuda
else
  echo "replicas: skipped (needs 2 GPUs, this device has $GPUS)"
  echo "sharded: skipped (FSDP2 on NCCL needs 2 GPUs, this device has $GPUS)"
fi
# Many devices, ready for real GPUs (issue 41): a process pinned to its GPU, the NCCL weight sync's
# digest, version and bounded memory, a hung replica on NCCL killed and replaced, a colocated trainer's
# offload; one `check <name>: ok|FAIL|skipped` line each, last line
# `many_devices: sync_s=.. offload_freed_mib=.. peak_gib_gpu0=..`. On one GPU the first three skip.
"$PY" bench/many_devices.py --device cuda
# FSDP2 with a resume, a streamed sync and the colocated layout (issue 41 item 8); last line
# `fsdp2_check: stream_peak_mib=.. model_mib=.. peak_gib_rank0=..`. Needs 2 GPUs; with fewer, skipped.
"$PY" bench/fsdp2_check.py --device cuda
