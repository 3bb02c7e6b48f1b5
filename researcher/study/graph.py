"""The study graph: LangGraph nodes and edges from brief to report, looping over rounds.

    load_brief -> workspace -> start_live -> plan -> validate ⟲ -> review ⟲ -> execute ⟲ -> prepare -> live -> launch
                                              ^                                                    |
                                            decide <- analyze <- monitor ⟲ (to launch while runs are queued) <-
                                              | stop    (analyze -> launch while re-runs of failed seeds are queued)
                                            report

`workspace` sets up the study's code workspace (when the brief has a `code:` section);
`validate` loops over the round's code proposals one at a time, so each validation is
checkpointed; review sees only proposals that validated. With human approval of code, validate runs
only the static checks, and `execute` runs an approved proposal's code (import, tests, smoke), one
proposal per visit, before `prepare` turns anything into a core run. `start_live` starts the brief's live run
(if any) before the first plan, and `live` keeps it going and swaps approved `hot_swap` proposals
into it (researcher/study/nodes/live.py). State is plain JSON; every node is idempotent: it recomputes
its answer from the state and looks up what it already did outside (proposal runs on MLflow,
launch intents, workspace refs) before acting. Review waits through
`interrupt()`; the runner resumes it with `Command(resume=decisions)`. This module wires the
graph; the nodes live in `researcher/study/nodes/`. The graph does not own processes, poll for
decisions, or print: the runner and CLI do.
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph

from researcher.evidence.study_records import StudyRecords
from researcher.study.nodes import StudyNodes
from researcher.study.nodes.base import StudyContext, StudyState, typed_values
from researcher.study.nodes.code import unexecuted, unvalidated

__all__ = ["NODES", "StudyContext", "StudyState", "build_graph", "typed_values"]


def _after_plan(state: StudyState) -> str:
    return "report" if state.get("stop_reason") else "validate"


def _after_validate(state: StudyState) -> str:
    return "validate" if unvalidated(StudyRecords.read(state)) else "review"


def _after_review(state: StudyState) -> str:
    study = StudyRecords.read(state)
    decided = {d.proposal_id for d in study.decisions}
    invalid = {pid for pid, v in study.versions.items() if not v.passed}
    return "review" if any(p.id not in decided | invalid for p in study.current) else "execute"


def _after_execute(state: StudyState) -> str:
    return "execute" if unexecuted(StudyRecords.read(state)) else "prepare"


def _after_monitor(state: StudyState) -> str:
    statuses = [x["status"] for x in state.get("launches", [])]
    if "queued" in statuses:
        return "launch"
    return "monitor" if "running" in statuses else "analyze"


def _after_analyze(state: StudyState) -> str:
    """Re-runs of failed seeds are queued by analyze and launched before anything is judged."""
    return "launch" if any(x["status"] == "queued" for x in state.get("launches", [])) else "decide"


def _after_decide(state: StudyState) -> str:
    return "report" if state.get("stop_reason") else "plan"


NODES = ("load_brief", "workspace", "start_live", "plan", "validate", "review", "execute", "prepare", "live", "launch",
         "monitor", "analyze", "decide", "report")


def _read_only(state: StudyState) -> dict[str, Any]:
    raise RuntimeError("this study graph was built for reading state; it cannot run nodes")


def build_graph(ctx: StudyContext | None) -> StateGraph:
    """The study graph; with ctx None, one whose nodes refuse to run (for reading checkpoints)."""
    nodes = StudyNodes(ctx) if ctx is not None else None
    g = StateGraph(StudyState)
    for name in NODES:
        g.add_node(name, getattr(nodes, name) if nodes is not None else _read_only)
    g.add_edge(START, "load_brief")
    g.add_edge("load_brief", "workspace")
    g.add_edge("workspace", "start_live")
    g.add_edge("start_live", "plan")
    g.add_conditional_edges("plan", _after_plan, ["validate", "report"])
    g.add_conditional_edges("validate", _after_validate, ["validate", "review"])
    g.add_conditional_edges("review", _after_review, ["review", "execute"])
    g.add_conditional_edges("execute", _after_execute, ["execute", "prepare"])
    g.add_edge("prepare", "live")
    g.add_edge("live", "launch")
    g.add_edge("launch", "monitor")
    g.add_conditional_edges("monitor", _after_monitor, ["launch", "monitor", "analyze"])
    g.add_conditional_edges("analyze", _after_analyze, ["launch", "decide"])
    g.add_conditional_edges("decide", _after_decide, ["plan", "report"])
    g.add_edge("report", END)
    return g
