"""One typed view of a study: its records and the questions its evidence answers.

`Study` is the study's records (`researcher.evidence.study_records.StudyRecords`, each validated once)
with what the evidence is measured against: the brief, the base config's values and its trainer steps.
Those are the five values the evidence functions take one by one (the proposals and results, the brief,
the base values, the default steps); a `Study` carries them together and answers with them: which
replication stage is `next_stage`, which recommendation is `owed` its confirmation, and the `conclusion`,
one `Recommendation` rendered as text. A graph node builds one per visit (`NodeBase._study`).

It decides nothing itself: it delegates to `stages`, `confirmation`, `baselines` and `matching`, whose
pure functions stay callable with loose records (the benches and their tests use them so). It is frozen:
a node that changes records writes new dicts into its update and never edits the view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from researcher.brief.schema import Brief
from researcher.evidence import baselines, confirmation, matching, stages
from researcher.evidence.study_records import StudyRecords
from researcher.records import Proposal

# A budget without limit: asking whether a stage is owed at all, before asking whether it can be paid.
UNLIMITED = 1 << 62


class Study(StudyRecords):
    """The study's records and what they are judged against: the brief, the base config's values and steps."""

    brief: Brief
    base_values: dict[str, Any]  # dotted key -> typed value of the resolved base run config
    base_steps: int  # trainer.steps of the resolved base config: a proposal's length unless it sets its own

    @classmethod
    def of(cls, state: Mapping[str, Any], brief: Brief, base_values: dict[str, Any], base_steps: int) -> Study:
        """The study of `state`, its records validated once, judged against `brief` and the base config."""
        return cls._validated(state, {"brief": brief, "base_values": base_values, "base_steps": base_steps})

    def steps(self, p: Proposal) -> int:
        """The trainer steps `p` runs: its own `trainer.steps`, else the base config's."""
        return p.steps(self.base_steps)

    def next_stage(self, number: int, runs_left: int, steps_left: int) -> list[Proposal] | None:
        """The two arms of the replication stage owed as round `number` within the budget left, or None."""
        return stages.next_stage(self.proposals, self.results, self.brief, self.base_values, self.base_steps, number,
                                 runs_left, steps_left, self.versions)

    def stage_owed(self) -> bool:
        """Whether a replication stage is owed, budget aside (the plan node checks that it can be paid)."""
        return self.next_stage(0, UNLIMITED, UNLIMITED) is not None

    def owed(self) -> Proposal | None:
        """The search's recommendation while its held-out-seed confirmation has not been run, else None."""
        return confirmation.owed(self.proposals, self.results, self.base_steps, self.brief)

    def evidence_owed(self) -> bool:
        """Whether the study still owes evidence: a confirmation round or a replication stage."""
        return self.owed() is not None or self.stage_owed()

    def confirmation_round(self, pick: Proposal, number: int, looks: list[int] | None) -> list[Proposal]:
        """The confirmation round of `pick` as round `number` (`looks`: its group-sequential design, or None)."""
        result = self.result_of(pick.id)
        if result is None:
            raise ValueError(f"{pick.id} has no result: there is nothing to confirm")
        return confirmation.proposals_for(pick, result, self.proposals, self.brief, self.base_values, self.base_steps,
                                          number, self.versions, looks)

    def recommendation(self) -> confirmation.Recommendation:
        """What the study concludes, its decision tree walked once."""
        return confirmation.recommendation(self.proposals, self.results, self.base_steps, self.brief)

    def conclusion(self) -> str:
        """What the study may recommend, in one sentence for its stop reason and report."""
        return self.recommendation().text()

    def baselines_needed(self, fresh: Sequence[Proposal], number: int) -> list[Proposal]:
        """The reference arms round `number` adds so each of `fresh` (and each candidate waiting) has its own."""
        return baselines.needed(fresh, self.proposals, self.decisions, self.base_values, self.base_steps, number,
                                self.results)

    def references_of(self, p: Proposal) -> list[Proposal]:
        """The arms `p` is judged against: its baseline and, for a chained code proposal, its parent's reference."""
        found = (matching.baseline_for(p, self.proposals, self.base_values, self.base_steps),
                 matching.parent_reference_for(p, self.proposals, self.base_values, self.base_steps))
        return [q for q in found if q is not None]

    def is_reference(self, p: Proposal) -> bool:
        """An arm others are judged against: it carries no verdict of its own."""
        return matching.is_reference(p, self.base_values)
