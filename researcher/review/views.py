"""One proposal seen whole: what `researcher study show` prints, built from the study state.

The view joins a proposal with its validation (code proposals), its review decision, its core
runs and its score. Its `status` is the one word a person asks for:
validating | invalid | pending | approved | vetoed | running | done | failed. This module reads;
it changes nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from researcher.brief.schema import Brief
from researcher.code.lineage import chain_of
from researcher.evidence.study_records import StudyRecords
from researcher.records import CodeVersion, Decision, ExperimentResult, Launch, Proposal

ProposalStatus = Literal["validating", "invalid", "pending", "approved", "vetoed", "running", "done", "failed"]


class ValidationView(BaseModel):
    passed: bool | None  # None while validating; config proposals pass trivially
    step: str | None  # the failed step, or None
    log: str  # every step's result and log tail


class RunView(BaseModel):
    mlflow_run_id: str | None
    status: str  # the launch status: queued | running | finished | failed | stopped | stalled | skipped
    key: str
    commit: str  # workspace commit the run's sandbox ran at ("" outside code studies)


class ProposalView(BaseModel):
    id: str
    kind: Literal["config", "code"]
    status: ProposalStatus
    hypothesis: str
    planner: str
    parent: str | None
    chain: list[str] = Field(default_factory=list)  # its ancestors through `parent`, the oldest first
    overrides: dict[str, Any]
    validation: ValidationView
    commit: str | None  # the proposal's workspace commit (code proposals that validated)
    decision: dict[str, Any] | None
    runs: list[RunView] = Field(default_factory=list)
    score: float | None  # mean objective over seeds, None until scored
    result: str  # the experiment's note, e.g. why it failed
    seed_scores: dict[int, float] = Field(default_factory=dict)  # seed -> score of each finished seed
    # Against the baseline (researcher/evidence/decision.py): {result, test, effect, ci, p}; None for the
    # baseline itself and until the experiment is scored.
    verdict: dict[str, Any] | None = None
    confirmation: str | None = None  # the held-out-seed confirmation of a recommendation, in words
    # A hot swap into the live run, an A/B: {step, old, new} (mean reward of each version over the
    # same `run.swap_window` steps after the swap; the verdict pairs them by step), `before` (the old
    # version's last steps up to the swap: a picture, never evidence), `after` (= new), n, versions,
    # the verdict and the version kept; None otherwise.
    swap: dict[str, Any] | None = None


def _status(p: Proposal, version: CodeVersion | None, decision: Decision | None, launches: list[Launch],
            result: ExperimentResult | None) -> ProposalStatus:
    if p.kind == "code" and version is None:
        return "validating"
    if version is not None and not version.passed:
        return "invalid"
    if decision is None:
        return "pending"
    if decision.verdict == "vetoed":
        return "vetoed"
    if result is not None:
        return "done" if result.status == "ok" else "failed"
    return "running" if any(x.status == "running" for x in launches) else "approved"


def proposal_view(state: dict[str, Any], proposal_id: str) -> ProposalView | None:
    """The view of one proposal, or None when the study has no such proposal."""
    return view_of(StudyRecords.read(state), proposal_id)


def view_of(study: StudyRecords, proposal_id: str) -> ProposalView | None:
    """The view of one proposal of the study's records, or None when it has no such proposal."""
    p = study.proposal(proposal_id)
    if p is None:
        return None
    version = next((v for v in study.code if v.proposal_id == p.id), None)
    decision = next((d for d in study.decisions if d.proposal_id == p.id), None)
    launches = [x for x in study.launches if x.proposal_id == p.id]
    result = study.result_of(p.id)
    if version is None:
        validation = ValidationView(passed=None if p.kind == "code" else True, step=None,
                                    log="" if p.kind == "code" else "(config proposal: nothing to validate)")
    else:
        validation = ValidationView(passed=version.passed, step=version.failed_step, log=version.log())
    score = result.summary.mean if result is not None and result.summary is not None and result.summary.n else None
    return ProposalView(
        id=p.id, kind=p.kind, status=_status(p, version, decision, launches, result), hypothesis=p.hypothesis,
        planner=p.planner, parent=p.parent, chain=chain_of(p.id, list(study.proposals)),
        overrides=p.overrides, validation=validation,
        commit=version.commit or None if version is not None else None,
        decision=decision.model_dump() if decision is not None else None,
        runs=[RunView(mlflow_run_id=x.run_id, status=x.status, key=x.key, commit=x.commit) for x in launches],
        score=score, result=result.note if result is not None else "",
        seed_scores=result.seed_scores if result is not None else {},
        verdict=result.verdict.json_view() if result is not None and result.verdict is not None else None,
        confirmation=result.confirmation.fmt() if result is not None and result.confirmation is not None else None,
        swap=_swap_view(study, p.id))


def _swap_view(study: StudyRecords, proposal_id: str) -> dict[str, Any] | None:
    swaps = [s for s in study.swaps if s.proposal_id == proposal_id]
    if not swaps:
        return None
    s = swaps[0]
    return {"step": s.step, "before": s.before.mean if s.before else None, "after": s.after.mean if s.after else None,
            "old": s.old.mean if s.old else None, "new": s.after.mean if s.after else None,
            "steps": sorted(s.after.steps) if s.after else [], "kept": s.kept, "n": s.n, "sandbox": s.sandbox, "from_version": s.from_version, "to_version": s.to_version,
            "verdict": s.verdict.json_view() if s.verdict else None}


def proposal_diff(state: dict[str, Any], proposal_id: str) -> str | None:
    """The code diff of a proposal (None when it has none: config proposals, or still validating)."""
    version = next((x for x in state.get("code", []) if x["proposal_id"] == proposal_id), None)
    return version["diff"] if version is not None else None


def status_json(name: str, state: dict[str, Any], phase: str, pid: int | None, brief: Brief) -> dict[str, Any]:
    """`researcher study status NAME --json`: the study's phase, spend, and every proposal's verdict."""
    study = StudyRecords.read(state)
    spent = study.spent(gpus=brief.launch.gpus)
    proposals = []
    for p in study.proposals:
        view = view_of(study, p.id)
        assert view is not None  # the id comes from the same state
        proposals.append({"id": view.id, "status": view.status, "verdict": view.verdict, "score": view.score,
                          "seeds": view.seed_scores, "confirmation": view.confirmation,
                          "overrides": view.overrides, "planner": view.planner})
    return {"study": name, "phase": phase, "round": state.get("round", 0), "running": pid is not None,
            "stop_reason": state.get("stop_reason", ""),
            "budget": {what: {"used": used, "limit": limit} for what, used, limit in spent.rows(brief)},
            "proposals": proposals}


def trained_steps(p: Proposal) -> int:
    return p.steps(0)


def best_result(study: StudyRecords, brief: Brief) -> tuple[Proposal, ExperimentResult] | None:
    """The best scored experiment among the longest-trained ones (`status` and the report).

    A score after more trainer steps is not comparable with one after fewer (successive halving
    trains survivors longer), so the longest runs are judged first.
    """
    proposals = {p.id: p for p in study.proposals}
    scored = [(proposals[r.proposal_id], r) for r in study.results
              if r.summary is not None and r.summary.n and r.proposal_id in proposals]
    if not scored:
        return None
    longest = max(trained_steps(p) for p, _ in scored)
    best: tuple[Proposal, ExperimentResult] | None = None
    for p, r in scored:
        if trained_steps(p) == longest and (best is None or brief.objective.better(r.summary.mean, best[1].summary.mean)):  # type: ignore[union-attr]
            best = (p, r)
    return best
