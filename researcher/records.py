"""What a study remembers: proposals, decisions, launches and experiment results.

These are plain pydantic values. The study graph keeps them (as dicts) in its checkpointed state,
the review surface mirrors proposals and decisions onto MLflow runs, and the report renders
them. Nothing here plans, launches or reads MLflow.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Verdict = Literal["approved", "vetoed"]
DecisionSource = Literal["cli", "mlflow", "policy"]
LaunchStatus = Literal["queued", "running", "finished", "failed", "stopped", "skipped"]
TERMINAL: frozenset[str] = frozenset({"finished", "failed", "stopped", "skipped"})


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ProposalDraft(BaseModel):
    """A planner's structured output for one experiment, before the study gives it an id."""

    model_config = ConfigDict(extra="forbid")

    hypothesis: str = Field(min_length=3)  # what we believe and want to test
    rationale: str = Field(min_length=3)  # why, from the brief and earlier results
    overrides: dict[str, Any] = Field(default_factory=dict)  # dotted run-config key -> value
    expected_effect: str = Field(min_length=3)  # what the objective should do if the hypothesis holds
    priority: int = Field(1, ge=1, le=10)  # 1 runs first
    needs_code_change: bool = False
    code_change: str | None = None  # "AREA: what to change" when needs_code_change

    @field_validator("code_change")
    @classmethod
    def _blank_is_none(cls, value: str | None) -> str | None:
        return value if value and value.strip() else None


class Proposal(ProposalDraft):
    id: str  # r<round>-<index>: stable across resumes
    round: int
    planner: str  # "heuristic" or "llm:<model>"
    arm: str | None = None  # heuristic: canonical id of the configuration
    rung: int | None = None  # heuristic: successive-halving rung

    def diff_text(self, base: dict[str, str]) -> str:
        """`key: old -> new` lines against the flattened base config."""
        rows = [f"{k}: {base.get(k, '(unset)')} -> {v}" for k, v in sorted(self.overrides.items())
                if base.get(k) != str(v)]
        if self.code_change:
            rows.append(f"code: {self.code_change}")
        return "\n".join(rows) or "(no change: baseline)"


class Decision(BaseModel):
    """Who decided what about a proposal, when and why."""

    proposal_id: str
    verdict: Verdict
    by: str  # the OS user or --by; "policy" for auto-approval; the tag's review.by for MLflow edits
    at: str = Field(default_factory=now_iso)
    reason: str = ""
    source: DecisionSource = "cli"


class Launch(BaseModel):
    """One core run: an approved experiment under one seed."""

    key: str  # <proposal id>-s<seed>: the identity that makes launches idempotent
    proposal_id: str
    seed: int
    steps: int  # trainer steps the run was asked for
    status: LaunchStatus = "queued"
    config_path: str = ""
    log_path: str = ""
    pid: int | None = None
    run_id: str | None = None  # MLflow run id written by `swarm run --run-id-file`
    started_at: float | None = None
    ended_at: float | None = None
    reason: str = ""  # why it failed, stopped or was skipped
    log_tail: str = ""  # last lines of the log of a failed run
    steps_done: int = 0


class Summary(BaseModel):
    """An objective over seeds: mean and a 95% confidence interval."""

    n: int
    mean: float
    std: float
    ci_low: float
    ci_high: float

    def fmt(self) -> str:
        if self.n == 0 or math.isnan(self.mean):
            return "n/a"
        if self.n == 1:
            return f"{self.mean:.4g} (1 seed)"
        return f"{self.mean:.4g} ± {(self.ci_high - self.ci_low) / 2:.2g} ({self.n} seeds)"


class ExperimentResult(BaseModel):
    proposal_id: str
    status: Literal["ok", "failed", "skipped"]
    values: list[float] = Field(default_factory=list)  # per-seed objective scores of usable runs
    summary: Summary | None = None
    note: str = ""
