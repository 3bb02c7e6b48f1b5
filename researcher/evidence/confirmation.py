"""The confirmation round: a recommendation stands only if it replicates on held-out seeds.

When the search is over, the experiment the study would recommend (judged `better` than the
baseline at the longest training, `decision.recommend`) and the baseline are run again at the
base config's full length on seeds the search never used. A code pick is confirmed at its own
commit, with its overrides (a chain, B built on A, at B's commit, which holds both); the baseline
runs at the base commit with the same overrides, so only the code differs. With replication on,
the confirmation is a group-sequential test: its looks are planned when it starts (`looks`, cut to
what the budget left can pay), every look is judged at its nominal level, and an inconclusive look
gets held-out seeds added (`researcher.evidence.stages`). The recommendation stands only when the
last look is `better`, and otherwise the report says the effect did not replicate, with each
look's evidence. One confirmation per study.

These are pure functions over the study's records: which proposals the confirmation round
needs, and what it concluded. The graph nodes launch and score them like any other round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from researcher.brief.schema import Brief
from researcher.evidence import decision
from researcher.evidence.analysis import config_of
from researcher.evidence.matching import is_reference, runs_code
from researcher.records import CodeVersion, ExperimentResult, Proposal

CONFIRMATION_PLANNER = "confirmation"


def _steps(p: Proposal, default_steps: int) -> int:
    return p.steps(default_steps)


def search_recommendation(proposals: Sequence[Proposal], results: Sequence[ExperimentResult], default_steps: int,
                          brief: Brief) -> tuple[Proposal, ExperimentResult] | None:
    """The search's pick (confirmation rounds excluded): `better` at the longest training, or None.

    Baselines carry no verdict, so they are never the pick.
    """
    by_id = {p.id: p for p in proposals if p.confirms is None and p.extends is None}  # a stage's verdict is its root's
    scored = [(by_id[r.proposal_id], r) for r in results if r.proposal_id in by_id]
    candidates = _candidates(scored, default_steps)
    pick = decision.recommend(candidates, brief.objective.direction)
    if pick is None:
        return None
    return next((p, r) for p, r in scored if p.id == pick.proposal_id)


def _candidates(scored: Sequence[tuple[Proposal, ExperimentResult]], default_steps: int) -> list[decision.Candidate]:
    return [decision.Candidate(proposal_id=p.id, steps=_steps(p, default_steps), verdict=r.verdict,
                               mean=r.summary.mean if r.summary else float("nan"),
                               parent=p.parent if runs_code(p) else None, parent_verdict=r.parent_verdict)
            for p, r in scored]


def not_kept(proposals: Sequence[Proposal], results: Sequence[ExperimentResult], default_steps: int) -> list[str]:
    """One sentence per chained proposal judged better than the base at the longest training but not better
    than its parent: why the study did not keep what it adds."""
    by_id = {p.id: p for p in proposals if p.confirms is None and p.extends is None}
    scored = [(by_id[r.proposal_id], r) for r in results if r.proposal_id in by_id]
    candidates = [c for c in _candidates(scored, default_steps) if c.verdict is not None]
    if not candidates:
        return []
    longest = max(c.steps for c in candidates)
    out = []
    for c in candidates:
        if c.steps == longest and c.verdict is not None and c.verdict.result == "better" and c.adds_nothing():
            against = c.parent_verdict.fmt() if c.parent_verdict else "never compared with it (its parent's arm did not finish)"
            out.append(f"{c.proposal_id} was judged better than the baseline but not better than its parent {c.parent} "
                       f"({against}), so its addition to {c.parent} was not kept")
    return out


def owed(proposals: Sequence[Proposal], results: Sequence[ExperimentResult], default_steps: int,
         brief: Brief) -> Proposal | None:
    """The recommendation that still needs its confirmation round, or None."""
    if not brief.confirm.enabled or any(p.confirms for p in proposals):
        return None
    found = search_recommendation(proposals, results, default_steps, brief)
    return found[0] if found else None


def proposals_for(pick: Proposal, result: ExperimentResult, proposals: Sequence[Proposal], brief: Brief,
                  base_values: dict[str, Any], default_steps: int, number: int,
                  code: dict[str, CodeVersion] | None = None, looks: list[int] | None = None) -> list[Proposal]:
    """The confirmation round: the pick (at its commit when it is code) and the baseline at full length on
    held-out seeds. `code`: the study's code versions by proposal id; `looks`: the group-sequential
    design (seeds per arm at each planned look), None for a fixed-size test."""
    version = (code or {}).get(pick.id)
    commit = pick.commit or (version.commit if version is not None and version.passed else None)
    if pick.kind == "code" and not commit:
        raise ValueError(f"{pick.id} is a code proposal without a valid code version: it cannot be confirmed")
    used = [*brief.seeds, *(s for p in proposals for s in (p.seeds or []))]
    seeds = decision.held_out_seeds(used, brief.confirm.seeds or len(brief.seeds))
    changed = config_of(pick)
    what = ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) or pick.id
    if commit:
        what += f" at commit {commit[:12]}"
    verdict = result.verdict.fmt() if result.verdict else "no verdict"
    common = dict(round=number, planner=CONFIRMATION_PLANNER, seeds=seeds, confirms=pick.id, priority=1, looks=looks)
    # A code pick's baseline runs its overrides at the base code: only the code differs (matching.py).
    reference = changed if runs_code(pick) or commit else {k: base_values.get(k) for k in changed}
    return [
        Proposal(id=f"r{number}-1", hypothesis=f"{what} beats the baseline on seeds the search never used",
                 rationale=f"confirmation of {pick.id}, judged better in the search: {verdict}",
                 expected_effect=f"better than the baseline again on held-out seeds {seeds}",
                 overrides={**changed, "trainer.steps": default_steps}, commit=commit, **common),
        Proposal(id=f"r{number}-2", hypothesis=f"the baseline, as the reference for confirming {pick.id}",
                 rationale=f"the baseline re-run on the same held-out seeds {seeds}",
                 expected_effect=f"worse than {pick.id} if its effect is real",
                 overrides={**reference, "trainer.steps": default_steps}, reference=True, **common),
    ]


def attach(results: list[ExperimentResult], proposals: Sequence[Proposal],
           base_values: dict[str, Any]) -> list[ExperimentResult]:
    """Copy a judged confirmation onto the result of the proposal it confirms."""
    by_id = {p.id: p for p in proposals}
    out = list(results)
    looks: dict[str, list[tuple[Proposal, ExperimentResult]]] = {}
    for r in results:
        p = by_id.get(r.proposal_id)
        if p is None or p.confirms is None or is_reference(p, base_values) or r.verdict is None:
            continue
        looks.setdefault(p.confirms, []).append((p, r))
    for pick, arms in looks.items():
        found = next((i for i, x in enumerate(out) if x.proposal_id == pick), None)
        if found is None:
            continue
        arms.sort(key=lambda pr: pr[0].stage)
        last = arms[-1][1].verdict
        assert last is not None
        conf = decision.Confirmation(proposal_id=pick, seeds=[s for p, _ in arms for s in p.seeds or []],
                                     verdict=last, replicated=last.result == "better",
                                     stages=[r.verdict for _, r in arms if r.verdict] if len(arms) > 1 or last.looks else [])
        out[found] = out[found].model_copy(update={"confirmation": conf})
    return out


class Recommendation(BaseModel):
    """What the study concludes, decided once (`recommendation`) and rendered as text (`text`)."""

    pick: Proposal | None = None  # the search's pick: better at the longest training (and than its parent)
    result: ExperimentResult | None = None  # the pick's result, its confirmation attached
    commit: str | None = None  # the code the pick's confirmation ran at; None: config only, or no pick
    confirm: bool = True  # the brief's confirm.enabled
    not_kept: list[str] = Field(default_factory=list)  # chained picks whose addition to their parent was not kept

    @property
    def recommended(self) -> bool:
        """Judged better and confirmed on held-out seeds (or better, with confirmation off)."""
        if self.pick is None or self.result is None:
            return False
        confirmed = self.result.confirmation
        return confirmed.replicated if confirmed is not None else not self.confirm

    def text(self) -> str:
        """What the study may recommend, in one sentence for its stop reason and report."""
        dropped = "; ".join(self.not_kept)
        if self.pick is None or self.result is None:
            if dropped:
                return f"nothing to recommend: {dropped}"
            return "no candidate was judged better than the baseline: nothing to recommend"
        return f"{self._said()} ({dropped})" if dropped else self._said()

    def _said(self) -> str:
        assert self.pick is not None and self.result is not None
        pick, confirmed = self.pick, self.result.confirmation
        if confirmed is None:
            if not self.confirm:
                return f"{pick.id} was judged better (confirmation is off in the brief): recommended unconfirmed"
            return f"{pick.id} was judged better but is not confirmed on held-out seeds: not recommended"
        if confirmed.replicated:
            return (f"recommend {pick.id}" + (f" (code at commit {self.commit})" if self.commit else "")
                    + f": {confirmed.fmt()}")
        return f"{pick.id} is not recommended: the effect {confirmed.fmt()}"


def recommendation(proposals: Sequence[Proposal], results: Sequence[ExperimentResult], default_steps: int,
                   brief: Brief) -> Recommendation:
    """The study's conclusion, walked once: its pick, the pick's confirmation and the chains not kept."""
    found = search_recommendation(proposals, results, default_steps, brief)
    dropped = not_kept(proposals, results, default_steps)
    if found is None:
        return Recommendation(confirm=brief.confirm.enabled, not_kept=dropped)
    pick, result = found
    return Recommendation(pick=pick, result=result, commit=commit_of(pick, proposals), confirm=brief.confirm.enabled,
                          not_kept=dropped)


def recommended(proposals: Sequence[Proposal], results: Sequence[ExperimentResult], default_steps: int,
                brief: Brief) -> tuple[Proposal, str | None] | None:
    """The proposal the study recommends and the commit of its code (None: the base code), or None."""
    found = recommendation(proposals, results, default_steps, brief)
    return (found.pick, found.commit) if found.recommended and found.pick is not None else None


def commit_of(pick: Proposal, proposals: Sequence[Proposal]) -> str | None:
    """The commit a pick's confirmation ran at (its code), else its own; None for config-only picks."""
    return next((p.commit for p in proposals if p.confirms == pick.id and p.commit), pick.commit)


def conclusion(proposals: Sequence[Proposal], results: Sequence[ExperimentResult], default_steps: int,
               brief: Brief) -> str:
    """What the study may recommend, in one sentence for its stop reason and report."""
    return recommendation(proposals, results, default_steps, brief).text()
