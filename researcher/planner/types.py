"""The planners' shared types: what a planner is given (`PlanContext`), what it returns (`PlanResult`), and how a study names its planner (`PlannerSpec`).

Types and the choice of spec only, so that the CLI and the study store can read a planner's spec
without importing any planner (and the OpenAI SDK the llm one needs). Planners are
`researcher.planner.heuristic` and `.llm`; `researcher.planner.factory` builds one from a spec.
"""


from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from researcher.brief.schema import Brief
from researcher.records import CodeVersion, Decision, ExperimentResult, Launch, Proposal, ProposalDraft


class PlannerError(RuntimeError):
    """The planner could not produce a usable plan; the message says why and what was tried."""

    def __init__(self, message: str, tokens: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens  # LLM tokens the failed attempts spent: they count against the study's budget


@dataclass
class PlanContext:
    brief: Brief
    base_values: dict[str, Any]  # dotted key -> typed value of the resolved base run config
    base_steps: int  # trainer.steps of the resolved base config
    round: int  # the round being planned, from 1
    proposals: list[Proposal] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    results: list[ExperimentResult] = field(default_factory=list)
    runs_left: int = 0
    steps_left: int = 0
    tokens_left: int = 0
    code: list[CodeVersion] = field(default_factory=list)  # earlier code proposals: diffs, validation, commits
    code_files: dict[str, str] = field(default_factory=dict)  # workspace path -> whole text, at the base commit
    # Valid code proposal id -> its files' whole text at its commit: what an edit on that parent applies to.
    version_files: dict[str, dict[str, str]] = field(default_factory=dict)
    launches: list[Launch] = field(default_factory=list)  # every core run so far: failures and their log tails

    def code_version(self, proposal_id: str) -> CodeVersion | None:
        found = [v for v in self.code if v.proposal_id == proposal_id]
        return found[-1] if found else None

    def files_for(self, parent: str | None) -> dict[str, str] | None:
        """The files an edit applies to: the base's, a valid parent's, or None for a parent unknown here."""
        return self.code_files if parent is None else self.version_files.get(parent)

    def verdict(self, proposal_id: str) -> Decision | None:
        found = [d for d in self.decisions if d.proposal_id == proposal_id]
        return found[-1] if found else None

    def result(self, proposal_id: str) -> ExperimentResult | None:
        found = [r for r in self.results if r.proposal_id == proposal_id]
        return found[-1] if found else None

    def cost(self, steps: int) -> tuple[int, int]:
        """(runs, trainer steps) one experiment of `steps` steps spends over the brief's seeds."""
        return len(self.brief.seeds), len(self.brief.seeds) * steps


@dataclass
class Planned:
    draft: ProposalDraft
    arm: str | None = None
    rung: int | None = None


@dataclass
class PlanResult:
    planned: list[Planned]
    done: bool = False  # the planner has nothing more to try
    note: str = ""  # shown to the person and kept in the report
    tokens: int = 0  # LLM tokens spent on this plan


class Planner(Protocol):
    name: str

    def plan(self, ctx: PlanContext) -> PlanResult: ...


class PlannerSpec(BaseModel):
    """How a study plans; stored with the study so a resume plans the same way. No secrets."""

    kind: str = "heuristic"  # heuristic | llm | manual (people propose; the study plans nothing itself)
    base_url: str | None = None
    model: str | None = None


def choose_planner(kind: str | None, base_url: str | None, model: str | None) -> PlannerSpec:
    """`--planner` wins; without it, llm when an endpoint is configured, else the offline heuristic."""
    base_url = base_url or os.environ.get("OPENAI_BASE_URL")
    model = model or os.environ.get("OPENAI_MODEL")
    if kind is None:
        kind = "llm" if base_url else "heuristic"
    if kind not in ("llm", "heuristic", "manual"):
        raise PlannerError(f"unknown planner {kind!r}: use llm, heuristic or manual")
    if kind == "llm" and not base_url:  # no model named: the endpoint's single served model (planner.endpoint)
        raise PlannerError("the llm planner needs an endpoint: pass --llm-base-url (and --llm-model when it serves "
                           "several models), or set OPENAI_BASE_URL (and OPENAI_MODEL)")
    return PlannerSpec(kind=kind, base_url=base_url if kind == "llm" else None,
                       model=model if kind == "llm" else None)
