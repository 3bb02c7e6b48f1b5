"""Verdicts for a batch of scored experiments, each against the reference that matches it.

Each candidate is compared with the reference `matching` gives it (base code with the candidate's own
overrides when it changes code; the base config when it changes config), on the seeds both finished,
seeds a plateau stopped scored at the same step in both arms (`pairing`); candidates sharing a
reference form one Holm–Bonferroni family. A chained code proposal is also judged against its
parent's code. A look of a group-sequential comparison (a replication stage, or a confirmation with
planned looks) is judged alone on its line's pooled seeds at the look's nominal level (`sequential`).
Pure functions over records: no MLflow (the caller's `score_at` reads runs), no launching.
"""

from __future__ import annotations

from collections.abc import Sequence

from researcher.brief.schema import Objective
from researcher.evidence import decision, pairing, sequential
from researcher.evidence.matching import (
    baseline_for,
    is_reference,
    line,
    parent_reference_for,
    root,
)
from researcher.records import Cost, ExperimentResult, Proposal


def arm_cost(costs: Sequence[Cost | None]) -> Cost | None:
    """An arm's cost per episode: each part's mean over the runs (or stages) that logged it; None when none did."""
    known = [c for c in costs if c is not None]
    if not known:
        return None
    parts = {name: [v for c in known if (v := getattr(c, name)) is not None] for name in ("calls", "tokens")}
    return Cost(**{name: sum(v) / len(v) if v else None for name, v in parts.items()})


def _incomplete(r: ExperimentResult) -> str:
    return f"seeds without a score: {r.note}" if r.failed_seeds else ""


def _pair(cand: Sequence[ExperimentResult], ref: Sequence[ExperimentResult],
          score_at: pairing.ScoreAt | None) -> tuple[dict[int, float], dict[int, float], str]:
    return pairing.aligned(pairing.arm(cand), pairing.arm(ref), score_at)


def _noted(v: decision.Verdict, note: str) -> decision.Verdict:
    return v.model_copy(update={"reason": "; ".join(x for x in (v.reason, note) if x)}) if note else v


def judge(results: list[ExperimentResult], proposals: list[Proposal], base_values: dict[str, object],
          default_steps: int, objective: Objective, known: list[ExperimentResult] | None = None,
          score_at: pairing.ScoreAt | None = None,
          boundary: sequential.Boundary = "obrien_fleming") -> list[ExperimentResult]:
    """Verdicts against the matching reference for a batch of new results, corrected together per reference.

    `known` are earlier results, where a reference may already be. A round may hold experiments of
    different lengths (rungs); each group shares one reference and one Holm–Bonferroni family. A
    chained code proposal also gets its verdict against its parent (`parent_verdict`). A look of a
    group-sequential comparison (a proposal with `looks`) is judged alone, on the seeds its line has
    pooled so far, at the look's nominal level (`boundary`'s spending). References keep `verdict=None`.
    `score_at` reads a run's score at a step, for seeds a plateau stopped (`pairing.aligned`).
    """
    by_id = {p.id: p for p in proposals}
    every = {r.proposal_id: r for r in [*(known or []), *results]}
    direction = objective.direction
    groups: dict[str | None, list[ExperimentResult]] = {}
    looks: list[ExperimentResult] = []
    for r in results:
        p = by_id.get(r.proposal_id)
        if p is None or is_reference(p, base_values):
            continue
        if p.looks:
            looks.append(r)
            continue
        base = baseline_for(p, proposals, base_values, default_steps)
        groups.setdefault(base.id if base else None, []).append(r)
    out = dict(every)
    for base_id, group in groups.items():
        base_result = every.get(base_id) if base_id else None
        if base_result is None:
            verdicts = decision.judge_round({r.proposal_id: r.seed_scores for r in group}, None, direction,
                                            incomplete={r.proposal_id: _incomplete(r) for r in group})
        elif base_result.status == "failed":  # ran, and no seed scored after its re-run (skipped: the budget)
            verdicts = {r.proposal_id: _baseline_failed(r, base_result) for r in group}
        else:
            raw, notes = {}, {}
            for r in group:
                cand, ref, notes[r.proposal_id] = _pair([r], [base_result], score_at)
                raw[r.proposal_id] = decision.compare(cand, ref, direction, baseline_id=base_id,
                                                      incomplete=_incomplete(r))
            verdicts = {k: _noted(v, notes[k]) for k, v in decision.holm(raw, direction).items()}
        for r in group:
            update: dict[str, object] = {"verdict": _costed(verdicts[r.proposal_id], [r],
                                                            [base_result] if base_result else [])}
            parent = parent_reference_for(by_id[r.proposal_id], proposals, base_values, default_steps)
            if parent is not None and parent.id in every:
                cand, ref, note = _pair([r], [every[parent.id]], score_at)
                update["parent_verdict"] = _costed(_noted(decision.compare(cand, ref, direction, baseline_id=parent.id,
                                                                           incomplete=_incomplete(r)), note),
                                                   [r], [every[parent.id]])
            out[r.proposal_id] = r.model_copy(update=update)
    for r in looks:
        out[r.proposal_id] = r.model_copy(update={"verdict": _look(r, by_id, every, base_values, default_steps,
                                                                   direction, score_at, boundary)})
    return [out[r.proposal_id] for r in results]


def _costed(v: decision.Verdict, cand: Sequence[ExperimentResult], ref: Sequence[ExperimentResult]) -> decision.Verdict:
    """The verdict with each arm's calls and tokens per episode (pooled over a line's stages): a harness that
    buys its score with more compute says so beside the score."""
    return v.model_copy(update={"cost": arm_cost([r.cost for r in cand]), "cost_baseline": arm_cost([r.cost for r in ref])})


def _baseline_failed(r: ExperimentResult, base: ExperimentResult) -> decision.Verdict:
    """A candidate whose baseline has no score on any seed after its re-run: not `inconclusive` (that says the
    two were compared and no difference found) but `incomplete`, until a later round runs the baseline again
    (`researcher.evidence.baselines.needed`) and `waiting` has it judged again."""
    return decision.Verdict(result="incomplete", test=decision.NO_TEST, n=len(r.seed_scores), baseline=base.proposal_id,
                            reason=f"its baseline {base.proposal_id} has no score on any seed ({base.note or base.status}); "
                                   "it is judged again when a later round runs that baseline")


def waiting(new: Sequence[ExperimentResult], known: Sequence[ExperimentResult], proposals: list[Proposal],
            base_values: dict[str, object], default_steps: int) -> list[ExperimentResult]:
    """Earlier results to judge again now that `new` holds their reference: a baseline (or a parent's reference)
    run again after the arm they were judged against failed. A comparison with looks (a stage, a confirmation
    with planned looks) keeps its design and is not judged again here."""
    fresh = {r.proposal_id for r in new}
    by_id = {p.id: p for p in proposals}
    out = []
    for r in known:
        p = by_id.get(r.proposal_id)
        if (p is None or r.proposal_id in fresh or r.verdict is None or r.stages or p.looks or p.extends
                or is_reference(p, base_values)):
            continue
        base = baseline_for(p, proposals, base_values, default_steps)
        parent = parent_reference_for(p, proposals, base_values, default_steps)
        if (base is not None and base.id in fresh and r.verdict.baseline != base.id) or (
                parent is not None and parent.id in fresh and (r.parent_verdict is None
                                                               or r.parent_verdict.baseline != parent.id)):
            out.append(r)
    return out


def _look(r: ExperimentResult, by_id: dict[str, Proposal], every: dict[str, ExperimentResult],
          base_values: dict[str, object], default_steps: int, direction: decision.Direction,
          score_at: pairing.ScoreAt | None, boundary: sequential.Boundary) -> decision.Verdict:
    """One look of a group-sequential comparison: the line's seeds so far against its reference's."""
    p = by_id[r.proposal_id]
    proposals = list(by_id.values())
    base = baseline_for(p, proposals, base_values, default_steps)
    if base is None:
        return decision.judge_round({p.id: r.seed_scores}, None, direction)[p.id]
    upto = [q for q in line(root(p, proposals), proposals) if q.stage <= p.stage]
    refs = [q for q in line(root(base, proposals), proposals) if q.stage <= p.stage]
    cand_results = [every[q.id] for q in upto if q.id in every]
    ref_results = [every[q.id] for q in refs if q.id in every]
    cand, ref, note = _pair(cand_results, ref_results, score_at)
    planned = tuple(p.looks or [])
    level = sequential.nominal_levels(planned, decision.ALPHA, boundary)[min(p.stage, len(planned)) - 1]
    failed = "; ".join(_incomplete(x) for x in cand_results if x.failed_seeds)
    verdict = _costed(decision.compare(cand, ref, direction, baseline_id=base.id, incomplete=failed, alpha=level),
                      cand_results, ref_results)
    return _noted(verdict, note).model_copy(update={"look": p.stage, "looks": len(planned), "level": level})
