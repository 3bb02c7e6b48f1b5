"""Test-wide environment: offline, single-threaded torch, throwaway MLflow and Ray state.

Fixtures that many test modules share live here: a live swarm server on a free loopback port with
the tiny model, and a tiny model trained in a few seconds to call a tool, so the tool path is tested
with a real model instead of a scripted one.
"""

from __future__ import annotations

import os
import tempfile

# Set before torch or mlflow import anywhere. One intra-op thread: the machine has 2 cores and the
# tests run servers and clients side by side; OpenMP spinning across them costs 20x on tiny ops.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
_scratch = tempfile.mkdtemp(prefix="swarmrl-tests-")
os.environ.setdefault("RAY_TMPDIR", os.path.join(_scratch, "ray"))
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_scratch}/mlflow.db"
os.environ.setdefault("SWARMRL_STATE", os.path.join(_scratch, "clients"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from tests.support import serve_policies, tool_calling_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tool_model():
    """A tiny model trained to call `add` after a user turn and to answer after a tool result."""
    return tool_calling_tiny()


@pytest.fixture
def live_server():
    """A factory: `live_server(**config_overrides)` -> a started Server on a free port, stopped afterwards."""
    started = []

    def start(policies=None, **overrides):
        server = serve_policies(policies, **overrides)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
