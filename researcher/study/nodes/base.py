"""What every study node shares: the checkpointed state, the outside world, and small helpers.

`StudyState` is plain JSON (records dumped to dicts) so the SqliteSaver checkpoint stays readable
and version-proof; a node reads it through one typed `Study` (researcher.evidence.study_view), built
once per node by `_study`, never by validating records itself. `StudyContext` is what nodes need that
is not state (MLflow, the review board, the launcher, the planner, the code workspace), built by the runner. `NodeBase` holds the helpers
the node mix-ins use. Nothing here is a node itself, and nothing here acts on the outside world.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from mlflow.tracking import MlflowClient

from core.config_io import flat_values, flatten
from researcher.brief.schema import Brief
from researcher.code.workspace import Workspace
from researcher.evidence.study_view import Study
from researcher.planner.types import Planner
from researcher.records import Launch
from researcher.review.mlflow_review import ReviewBoard
from researcher.runs.launcher import Emit, Launcher
from researcher.runs.live_watch import LiveWatch
from researcher.study.store import StudyPaths


class StudyState(TypedDict, total=False):
    study: str
    round: int  # rounds planned so far
    proposals: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    launches: list[dict[str, Any]]
    results: list[dict[str, Any]]
    notes: list[dict[str, Any]]  # per plan: round, planner, note, tokens, seconds spent planning
    tokens_used: int
    compute_s: float  # wall-clock of finished rounds (launch to last run end)
    round_started: float | None  # when the current round's first run started
    workspace_base: str  # the code workspace's base commit ("" when the brief edits no code)
    sealed_judges: dict[str, Any]  # the SealedJudges every run is scored by (researcher.code.sealed); {} without code
    code: list[dict[str, Any]]  # one CodeVersion per code proposal: validation steps and commit
    live: dict[str, Any]  # the live run's Launch (brief `run.live: true`); {} without one
    swaps: list[dict[str, Any]]  # one SwapResult per hot swap into the live run
    stop_reason: str
    report: str


@dataclass
class StudyContext:
    """Everything the nodes need that is not state: the outside world, built by the runner."""

    name: str
    brief: Brief
    paths: StudyPaths
    workdir: Path
    client: MlflowClient
    board: ReviewBoard
    launcher: Launcher
    planner: Planner
    emit: Emit
    workspace: Workspace | None = None  # None when the brief has no `code:` section


def dump(items: list[Any]) -> list[dict[str, Any]]:
    return [x.model_dump() for x in items]


def typed_values(cfg_dump: dict[str, Any]) -> dict[str, Any]:
    """A dumped run config as `a.b.c -> value` with the values' own types (planners compare them)."""
    return flat_values(cfg_dump)


class NodeBase:
    """The helpers the node mix-ins share; `StudyNodes` combines the mix-ins into one object."""

    def __init__(self, ctx: StudyContext) -> None:
        self.ctx = ctx
        base = ctx.brief.resolve_config(ctx.workdir)
        self.base_flat = flatten(base)
        self.base_values = typed_values(base.model_dump())
        self.base_steps = base.trainer.steps

    def _study(self, state: StudyState) -> Study:
        """The node's one typed view of `state`, judged against the brief and the base config."""
        return Study.of(state, self.ctx.brief, self.base_values, self.base_steps)

    def _enter(self, node: str, state: StudyState) -> None:
        self.ctx.emit("node", node=node, round=state.get("round", 0))

    def _watch_live(self, state: StudyState) -> dict[str, Any]:
        """The live run refreshed (stopped if it diverged, stalled or spent the budget), as the state's
        `live`; {} without one. Nodes that read the budget call it first, so a live run that died in a
        downtime is billed to its last sign of life, not to the moment the resumed study looked."""
        if not state.get("live"):
            return {}
        watch = LiveWatch(self.ctx.launcher, self.ctx.client, self.ctx.brief, self.ctx.emit)
        return watch.check(Launch.model_validate(state["live"]), state).model_dump()

    @staticmethod
    def _concluded(study: Study, why: str) -> str:
        """A stop reason that also says what the study may recommend."""
        return f"{why}; {study.conclusion()}"
