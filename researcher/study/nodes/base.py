"""What every study node shares: the checkpointed state, the outside world, and small helpers.

`StudyState` is plain JSON (records dumped to dicts) so the SqliteSaver checkpoint stays readable
and version-proof. `StudyContext` is what nodes need that is not state (MLflow, the review board,
the launcher, the planner, the code workspace), built by the runner. `NodeBase` holds the helpers
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
from researcher.evidence import confirmation, stages
from researcher.planner.types import Planner
from researcher.records import CodeVersion, Decision, ExperimentResult, Launch, Proposal
from researcher.review.mlflow_review import ReviewBoard
from researcher.runs.launcher import Emit, Launcher
from researcher.runs.live_watch import LiveWatch
from researcher.study.store import StudyPaths

# A budget without limit: asking whether a stage is owed at all, before asking whether it can be paid.
UNLIMITED = 1 << 62


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


def models_of(items: list[dict[str, Any]] | None, cls: type) -> list[Any]:
    return [cls.model_validate(x) for x in items or []]


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

    def _current(self, state: StudyState) -> list[Proposal]:
        return [p for p in models_of(state.get("proposals"), Proposal) if p.round == state.get("round", 0)]

    @staticmethod
    def _verdicts(state: StudyState) -> dict[str, Decision]:
        return {d.proposal_id: d for d in models_of(state.get("decisions"), Decision)}

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

    def _steps(self, p: Proposal) -> int:
        return p.steps(self.base_steps)

    def _confirmation_owed(self, state: StudyState) -> Proposal | None:
        """The search's recommendation, while its held-out-seed confirmation has not been run."""
        return confirmation.owed(models_of(state.get("proposals"), Proposal),
                                 models_of(state.get("results"), ExperimentResult), self.base_steps, self.ctx.brief)

    def _stage_owed(self, state: StudyState) -> bool:
        """Whether a replication stage is owed, budget aside (the plan node checks that it can be paid)."""
        if not self.ctx.brief.replicate.enabled:
            return False
        return stages.next_stage(models_of(state.get("proposals"), Proposal),
                                 models_of(state.get("results"), ExperimentResult), self.ctx.brief, self.base_values,
                                 self.base_steps, 0, runs_left=UNLIMITED, steps_left=UNLIMITED,
                                 code={v.proposal_id: v for v in models_of(state.get("code"), CodeVersion)}) is not None

    def _concluded(self, state: StudyState, why: str) -> str:
        """A stop reason that also says what the study may recommend."""
        return f"{why}; " + confirmation.conclusion(models_of(state.get("proposals"), Proposal),
                                                     models_of(state.get("results"), ExperimentResult),
                                                     self.base_steps, self.ctx.brief)
