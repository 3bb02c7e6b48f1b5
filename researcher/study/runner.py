"""Driving a study: build its context, run the graph under the checkpointer, wait for reviews.

`run_study` owns the study (its lock) for as long as it runs. It compiles the graph with a
`SqliteSaver` (one thread per study, `durability="sync"`), starts or resumes it, and whenever the
graph stops at the review interrupt it polls MLflow for decisions (from `researcher study
approve/veto` or a tag edited in the UI) and resumes with `Command(resume=decisions)`. Between
polls it sleeps, so a wait of days costs no CPU. With `wait_for_review=False` it returns at the
interrupt instead; a later `approve` or `resume` picks the study up where it stopped.

It does not print (events go to the `emit` callback) and installs no signal handlers.
"""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command
from mlflow.tracking import MlflowClient

from researcher.brief.loader import load_brief
from researcher.brief.schema import Brief
from researcher.code.workspace import Workspace
from researcher.evidence.study_records import StudyRecords
from researcher.planner.factory import make_planner
from researcher.planner.types import PlannerSpec
from researcher.records import Decision, now_iso
from researcher.review.mlflow_review import ReviewBoard
from researcher.runs.backends import make_launcher
from researcher.runs.launcher import Emit, LaunchTarget
from researcher.runs.live_watch import LiveWatch, in_review
from researcher.runs.warm import study_warm
from researcher.study.graph import StudyContext, build_graph
from researcher.study.store import (
    StudyFailed,
    StudyLock,
    StudyMeta,
    StudyPaths,
    create_study,
    default_swarm_command,
    experiment_name,
    load_meta,
    mark_failed,
    private_paths,
    resolve_tracking_uri,
    study_brief,
    study_paths,
)

log = logging.getLogger(__name__)

# LangGraph stops a thread after this many super-steps per invoke; a study loops through its
# nodes for days, so the bound must never be what ends it (the brief's budgets do).
RECURSION_LIMIT = 1_000_000


@dataclass
class StudyProgress:
    done: bool  # the study reached its report
    stop_reason: str = ""
    report: str | None = None
    waiting: list[str] = field(default_factory=list)  # proposals awaiting a decision when it returned
    state: dict[str, Any] = field(default_factory=dict)


def new_study(studies_dir: Path, brief_path: Path, name: str, planner: PlannerSpec, workdir: Path,
              tracking_uri: str | None) -> tuple[StudyPaths, StudyMeta, Brief]:
    """Validate the brief and create the study's folder; nothing runs yet."""
    brief = load_brief(brief_path, workdir)
    paths = study_paths(studies_dir, name)
    meta = StudyMeta(name=name, brief_source=str(brief_path), workdir=str(workdir),
                     tracking_uri=resolve_tracking_uri(tracking_uri, workdir), experiment=experiment_name(name),
                     planner=planner, created_at=now_iso())
    create_study(paths, brief_path.read_text(), meta)
    return paths, meta, brief


def thread_config(name: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": name}, "recursion_limit": RECURSION_LIMIT}


def _artifacts(paths: StudyPaths, meta: StudyMeta) -> Path | None:
    """The study's own artifact folder when the store is local; a server keeps its own default."""
    return None if meta.tracking_uri.startswith(("http://", "https://", "databricks")) else paths.state / "artifacts"


def open_board(meta: StudyMeta) -> ReviewBoard:
    return ReviewBoard(MlflowClient(meta.tracking_uri), meta.experiment, meta.name)


def build_context(paths: StudyPaths, meta: StudyMeta, emit: Emit, warm: str | None = None) -> StudyContext:
    """`warm`: the socket of the study's `swarm warm` (researcher.runs.warm) its runs fork from."""
    brief = study_brief(paths, meta)
    client = MlflowClient(meta.tracking_uri)
    target = LaunchTarget(command=brief.launch.command or default_swarm_command(), workdir=Path(meta.workdir),
                          tracking_uri=meta.tracking_uri, experiment=meta.experiment, study=meta.name,
                          containment=brief.containment, warm=warm,
                          hidden=tuple(private_paths(paths, meta.tracking_uri)),
                          judges=paths.judges if brief.code else None)
    workspace = Workspace(paths.workspace, brief.code, Path(meta.workdir)) if brief.code else None
    return StudyContext(name=meta.name, brief=brief, paths=paths, workdir=Path(meta.workdir), client=client,
                        board=ReviewBoard(client, meta.experiment, meta.name, _artifacts(paths, meta)),
                        launcher=make_launcher(brief.launch, target, paths.state, emit, workspace),
                        planner=make_planner(meta.planner), emit=emit, workspace=workspace)


@contextmanager
def _compiled(paths: StudyPaths, ctx: StudyContext | None) -> Iterator[Any]:
    paths.state.mkdir(parents=True, exist_ok=True)
    with SqliteSaver.from_conn_string(str(paths.db)) as saver:
        yield build_graph(ctx).compile(checkpointer=saver)


def read_state(paths: StudyPaths, name: str) -> tuple[dict[str, Any], tuple[str, ...], list[str]]:
    """(state values, next nodes, proposals the review interrupt waits on) without running anything."""
    if not paths.db.exists():
        return {}, (), []
    with _compiled(paths, None) as app:
        snap = app.get_state(thread_config(name))
        waiting = [pid for i in snap.interrupts for pid in (i.value or {}).get("pending", [])]
        return dict(snap.values or {}), unfinished(snap), waiting


def unfinished(snap: Any) -> tuple[str, ...]:
    """The nodes still to run or to finish. Not LangGraph's `snap.next`: that leaves out a node whose
    writes are saved while the checkpoint after it is not yet, so a study read (or killed) in that window
    would look done; its tasks hold every node of the step."""
    return tuple(t.name for t in snap.tasks)


def wait_for_decisions(board: ReviewBoard, pending: list[str], poll_s: float, stop: threading.Event,
                       decided: list[Decision], emit: Emit,
                       watch: Callable[[], None] | None = None) -> list[dict[str, Any]] | None:
    """Decisions for any of `pending` as soon as MLflow has one; None if asked to stop first.
    Meanwhile, edits of the `decided` proposals' tags are recorded as ignored, and `watch` (the live
    run's, `live_watch.in_review`) is called between polls."""
    while not stop.is_set():
        for change in board.audit(decided):
            emit("review.ignored", **change.model_dump())
        found = board.collect(pending)
        if found:
            return [d.model_dump() for d in found]
        if watch is not None:
            watch()
        stop.wait(poll_s)  # sleeps; wakes early only to stop
    return None


def run_study(paths: StudyPaths, emit: Emit, *, wait_for_review: bool = True,
              stop: threading.Event | None = None) -> StudyProgress:
    """Start or resume the study at `paths` and drive it to its report (or to a review, see above)."""
    stop = stop or threading.Event()
    meta = load_meta(paths)
    with StudyLock(paths), study_warm(paths.state, Path(sys.executable).parent / "swarm") as warm:
        ctx = build_context(paths, meta, emit, warm)
        cfg = thread_config(meta.name)
        with _compiled(paths, ctx) as app:
            snap = app.get_state(cfg)
            fresh = not snap.values
            if not fresh and not unfinished(snap):
                values = dict(snap.values)
                return StudyProgress(done=True, stop_reason=values.get("stop_reason", ""), report=values.get("report"),
                               state=values)
            emit("study.start" if fresh else "study.resume", study=meta.name)
            command: Any = {"study": meta.name} if fresh else None
            while True:
                if snap.interrupts and not fresh:
                    pending = [pid for i in snap.interrupts for pid in (i.value or {}).get("pending", [])]
                    answer = [d.model_dump() for d in ctx.board.collect(pending)] or None
                    if answer is None and wait_for_review:
                        emit("review.waiting", ids=pending, poll_s=ctx.brief.review.poll_s)
                        decided = list(StudyRecords.read(snap.values).decisions)
                        watch = in_review(LiveWatch(ctx.launcher, ctx.client, ctx.brief, emit), snap.values,
                                          ctx.brief.monitor.poll_s)
                        answer = wait_for_decisions(ctx.board, pending, ctx.brief.review.poll_s, stop, decided, emit,
                                                    watch)
                    if answer is None:
                        return StudyProgress(done=False, waiting=pending, state=dict(snap.values))
                    command = Command(resume=answer)
                try:
                    app.invoke(command, cfg, durability="sync")
                except Exception as e:  # noqa: BLE001 - whatever a node raised, the study cannot go on
                    node = ", ".join(unfinished(app.get_state(cfg))) or "start"
                    line = mark_failed(paths, node, f"{type(e).__name__}: {e}")
                    emit("study.failed", study=meta.name, reason=line)
                    log.debug("study %s failed", meta.name, exc_info=True)
                    raise StudyFailed(line) from e
                paths.failed.unlink(missing_ok=True)  # a resume got past what failed before
                fresh, command = False, None
                snap = app.get_state(cfg)
                if not unfinished(snap):
                    values = dict(snap.values)
                    emit("study.done", study=meta.name, stop_reason=values.get("stop_reason", ""))
                    return StudyProgress(done=True, stop_reason=values.get("stop_reason", ""),
                                   report=values.get("report"), state=values)
