"""`researcher study status` reads the state without LangGraph: it must agree with LangGraph.

The checkpoints here are real ones: the study graph compiled with the `SqliteSaver` a study uses,
moved through its phases with `update_state` (as the nodes' writes would). After each, the direct
reader (`researcher.study.snapshot`) and LangGraph's own `get_state` (`runner.read_state`) must give the
same values, next nodes and waiting proposals; where the reader cannot tell, it says so (None).
A study really waiting at the review interrupt is covered by tests/researcher/test_study.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from langgraph.checkpoint.sqlite import SqliteSaver

from researcher.records import Decision, Proposal
from researcher.study import runner, snapshot
from researcher.study.graph import build_graph
from researcher.study.store import study_paths

PROPOSAL = Proposal(id="r1-1", round=1, planner="heuristic", hypothesis="a higher lr learns faster",
                    rationale="the baseline is slow", expected_effect="higher reward", overrides={"trainer.lr": 0.01}
                    ).model_dump()
DECISION = Decision(proposal_id="r1-1", verdict="approved", by="ada").model_dump()


def test_reader_agrees_with_langgraph_through_the_phases(tmp_path: Path) -> None:
    paths = study_paths(tmp_path, "s")
    assert snapshot.read_state(paths, "s") == ({}, (), [])  # a study that never ran
    paths.state.mkdir(parents=True)
    cfg = runner.thread_config("s")
    steps = [  # (node whose writes these are, writes)
        (None, {"study": "s"}),
        ("load_brief", {"round": 0}),
        ("workspace", {"workspace_base": ""}),
        ("plan", {"round": 1, "proposals": [PROPOSAL], "notes": [], "stop_reason": ""}),
        ("validate", {"code": []}),
        ("review", {"decisions": [DECISION]}),
        ("prepare", {"launches": [{"proposal_id": "r1-1", "status": "queued", "key": "r1-1-s0"}]}),
        ("launch", {"launches": [{"proposal_id": "r1-1", "status": "running", "key": "r1-1-s0"}]}),
        ("monitor", {"launches": [{"proposal_id": "r1-1", "status": "finished", "key": "r1-1-s0"}]}),
        ("analyze", {"results": [], "compute_s": 1.5}),
        ("decide", {"stop_reason": "budget: 1 rounds done"}),
        ("report", {"report": "report.md"}),
    ]
    seen = []
    with SqliteSaver.from_conn_string(str(paths.db)) as saver:
        app = build_graph(None).compile(checkpointer=saver)
        for node, writes in steps:
            app.update_state(cfg, writes, as_node=node or "__start__")
            expected = runner.read_state(paths, "s")
            assert snapshot.read_state(paths, "s") == expected, node
            seen.append(expected[1])
        assert seen[3] == ("validate",) and seen[-2] == ("report",) and seen[-1] == ()  # the phases really moved
        # A node that saved some writes and then died: only LangGraph knows how they apply.
        latest = saver.get_tuple(cfg)
        saver.put_writes(latest.config, [("round", 2)], task_id="a-task-that-died")
    assert snapshot.read_state(paths, "s") is None


def test_unknown_database_is_left_to_langgraph(tmp_path: Path) -> None:
    paths = study_paths(tmp_path, "s")
    paths.state.mkdir(parents=True)
    paths.db.write_bytes(b"not a sqlite database at all, just bytes")
    assert snapshot.read_state(paths, "s") is None


def test_status_answers_without_mlflow_or_the_graph(tmp_path: Path) -> None:
    """`status` of a study past its review: phase and budget, with no MLflow, graph, scipy or torch loaded."""
    from researcher.planner.types import PlannerSpec

    root = Path(__file__).resolve().parents[2]
    paths, _, _ = runner.new_study(tmp_path, root / "studies" / "tiny-lr.md", "s", PlannerSpec(kind="heuristic"), root,
                                   f"sqlite:///{tmp_path}/mlflow.db")
    with SqliteSaver.from_conn_string(str(paths.db)) as saver:
        app = build_graph(None).compile(checkpointer=saver)
        cfg = runner.thread_config("s")
        for node, writes in [("__start__", {"study": "s"}), ("plan", {"round": 1, "proposals": [PROPOSAL]}),
                             ("review", {"decisions": [DECISION]})]:
            app.update_state(cfg, writes, as_node=node)
    heavy = ("mlflow", "langgraph.graph", "langgraph.pregel", "scipy", "torch", "transformers")
    probe = ("import sys\nfrom researcher.cli.main import app\ntry:\n    app(sys.argv[1:], standalone_mode=False)\n"
             f"finally:\n    print('loaded', sorted(m for m in {heavy!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe, "study", "--studies-dir", str(tmp_path), "status", "s"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "phase execute, round 1; not running" in out.stdout and "trainer steps" in out.stdout
    assert "pending reviews" not in out.stdout and out.stdout.strip().endswith("loaded []")


def test_a_node_whose_writes_are_saved_before_the_next_checkpoint_is_not_read_as_done(tmp_path: Path) -> None:
    """Between a node saving its writes and the checkpoint after it, LangGraph's `next` leaves that node
    out: a study in the middle of its launches read as finished (a test's wait returned with a run still
    going), and a study killed in that window would resume as done. `read_state` counts it."""
    paths = study_paths(tmp_path, "s")
    paths.state.mkdir(parents=True)
    cfg = runner.thread_config("s")
    with SqliteSaver.from_conn_string(str(paths.db)) as saver:
        app = build_graph(None).compile(checkpointer=saver)
        for node, writes in [("__start__", {"study": "s"}), ("plan", {"round": 1, "proposals": [PROPOSAL]}),
                             ("review", {"decisions": [DECISION]}), ("prepare", {"launches": []}),
                             ("live", {}), ("launch", {"launches": []})]:
            app.update_state(cfg, writes, as_node=node)
        [monitor] = app.get_state(cfg).tasks
        assert monitor.name == "monitor" and runner.read_state(paths, "s")[1] == ("monitor",)
        saver.put_writes(saver.get_tuple(cfg).config, [("launches", [])], task_id=monitor.id)
        assert app.get_state(cfg).next == ()  # LangGraph's own answer: nothing left
    values, nxt, waiting = runner.read_state(paths, "s")
    assert values["round"] == 1 and nxt == ("monitor",) and waiting == []
    assert snapshot.read_state(paths, "s") is None  # the direct reader leaves such writes to LangGraph
