"""Test-wide environment: offline, single-threaded torch, throwaway MLflow and Ray state.

Fixtures that many test modules share live here: a live swarm server on a free loopback port with
the tiny model, and a tiny model trained in a few seconds to call a tool, so the tool path is tested
with a real model instead of a scripted one.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Set before torch or mlflow import anywhere. One intra-op thread: the machine has 2 cores and the
# tests run servers and clients side by side; OpenMP spinning across them costs 20x on tiny ops.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Per process, set unconditionally: under pytest-xdist each worker imports this file with the
# environment the controller set up, so `setdefault` would hand every worker the same client pid
# folder and Ray temp dir. Each worker gets its own MLflow store, client state and Ray state.
_scratch = tempfile.mkdtemp(prefix="swarmrl-tests-")
atexit.register(shutil.rmtree, _scratch, ignore_errors=True)  # each process removes its own when it ends
os.environ["RAY_TMPDIR"] = os.path.join(_scratch, "ray")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_scratch}/mlflow.db"
os.environ["SWARMRL_STATE"] = os.path.join(_scratch, "clients")

import pytest  # noqa: E402
import torch  # noqa: E402

try:  # pytest >= 9.2: structured node ids (see pytest_collection_modifyitems)
    from _pytest.nodeid import NodeId  # noqa: E402
except ImportError:
    NodeId = None

torch.set_num_threads(1)

from tests.support import serve_policies, tool_calling_tiny, tool_calling_tiny_shared  # noqa: E402


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny model trained to call `add` after a user turn and to answer after a tool result."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tool_calling_tiny()
    # Under xdist the base temp is per worker and its parent is this session's, shared by the workers.
    return tool_calling_tiny_shared(tmp_path_factory.getbasetemp().parent)


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


# The modules holding the longest tests, longest first (`pytest --durations`, 3 workers on a 2-core machine,
# the study tests' runs forked from `swarm warm`; the new modules of 2026-12-05 timed on 2 workers, busy).
# xdist hands tests out in collection order, so starting these first lets the short ones fill in at the
# end; collected last, one worker once ran the final study test alone.
LONGEST_FIRST = (  # each module's wall time in the suite (3 workers), longest first; --durations, 2026-12-05
    "tests/researcher/test_soak.py",  # the 3-minute soak (bench/soak.py --minutes 3)
    "tests/test_readme.py",  # 178 s: the README's commands, cold as a user runs them
    "tests/researcher/test_live_ab_real.py",  # two real A/B swaps into a live tiny run: 8 min under load
    "tests/researcher/test_decision_study.py",  # five study tests, ~260 s in all
    "tests/researcher/test_hostile_proposals.py",  # one module fixture: ~200 s on one worker
    "tests/researcher/test_hostile_yardstick_study.py",  # 172 s: twelve study runs
    "tests/researcher/test_study.py",  # kill -9 in every node 150 s
    "tests/core/test_agent_apis.py",  # 117 s: trains the tool-calling tiny model when first to ask
    "tests/core/test_chaos.py",
    "tests/researcher/test_code_study.py",
    "tests/researcher/test_planted_code_study.py",
    "tests/core/test_replicas.py",  # ~100 s: replica processes per test
    "tests/core/test_ray_replicas.py",  # 82 s: a local Ray cluster with replica actors
    "tests/core/test_replica_run.py",  # ~80 s: a whole run on 2 replicas and 2 ranks
    "tests/core/test_sharded_trainer.py",  # 2-rank FSDP2 processes, and a whole run on them
    "tests/researcher/test_live_swap.py",
    "tests/researcher/test_review_ui.py",  # a study beside a real mlflow server and chromium
    "tests/researcher/test_ray_jobs.py",
    "tests/core/test_seeds_runs.py",  # 58 s: two runs with 16 episodes in flight
    "tests/core/test_distributed_trainer.py",
    "tests/researcher/test_study_warm.py",  # 44 s
    "tests/core/test_resume_mlflow.py",
    "tests/core/test_gateway.py",
    "tests/core/test_ray.py",
    "tests/core/test_warm.py",
    "tests/researcher/test_study_failed.py",  # 33 s
    "tests/researcher/test_review_rest.py",
)


# Long scenario tests run in `make test-long` (which .ci/run runs after `make test`), so `make test` stays a
# quick answer: whole studies, the soak, kill -9 in every node, the README's commands and live A/B swaps.
# Marked here, in one place, by module or node id (the soak's test also carries the marker itself).
LONG = (
    "tests/researcher/test_soak.py::test_three_minute_soak_under_random_kills_keeps_its_books",
    "tests/researcher/test_study.py::test_kill_9_in_every_node_loses_and_duplicates_nothing",
    "tests/test_readme.py",
    "tests/researcher/test_live_ab_real.py",
    "tests/researcher/test_decision_study.py",
    "tests/researcher/test_hostile_yardstick_study.py",
    "tests/researcher/test_planted_code_study.py",
)


def _is_long(item) -> bool:
    return any(item.nodeid == x or item.nodeid.startswith(x + "::") for x in LONG)


def _longest_first(item) -> int:
    module = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Keep each module's tests that share a module- or class-scoped fixture on one xdist worker.

    `make test` spreads tests over workers one by one (`--dist loadgroup`), so the long tests do not
    queue behind each other; but a shared fixture (a tracking server, a trained run) would then be
    built again on every worker that draws one of its tests. Grouping those tests by file builds it once.
    """
    for item in items:
        if _is_long(item):
            item.add_marker(pytest.mark.long)
    items.sort(key=_longest_first)
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope in ("module", "class") for chain in defs for d in chain):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and NodeId is not None and isinstance(getattr(item, "_id", None), NodeId):
            # xdist reads the group from an `@group` suffix on the node id, which it writes to the
            # legacy `_nodeid`; pytest 9.2's structured ids ignore that, and grouped tests would be
            # spread one by one (pytest-dev/pytest-xdist#1386). Write the suffix where pytest reads it.
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")
