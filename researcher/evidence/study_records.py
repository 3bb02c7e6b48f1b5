"""The study's records, typed: its checkpointed state validated once, in this one place.

The study's state is plain JSON (`researcher.study.nodes.base.StudyState`: records dumped to dicts) so
the checkpoint stays readable. `StudyRecords.read(state)` validates every record of it once, and a bad
record fails here with the field it broke (`proposals[2].round: ...`), not deep inside whichever node
or command read it first. The view is a frozen snapshot: whoever changes records writes new dicts into
the state and reads it again. It answers only what the records say by themselves (the round's proposals,
each proposal's decision and code version, what it spent); `researcher.evidence.study_view.Study` adds the base
config and the evidence drawn from it. It imports only the foundation (records, budget), so the command line
reads a study without loading MLflow or the statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from researcher.budget import Spent
from researcher.records import CodeVersion, Decision, ExperimentResult, Launch, Proposal, SwapResult

# The state's fields this view holds, validated; the rest (notes, stop reason, report) the nodes read as they are.
RECORD_FIELDS = ("round", "proposals", "decisions", "launches", "results", "code", "swaps", "live", "tokens_used")


class StudyStateError(ValueError):
    """A record of the study's state does not validate; the message names each field that broke."""


def _where(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the state's path: ('proposals', 2, 'round') -> 'proposals[2].round'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class StudyRecords(BaseModel):
    """The study's records, typed: what a reader needs that has no base config at hand (the report, the CLI)."""

    model_config = ConfigDict(frozen=True)

    round: int = 0  # rounds planned so far
    proposals: tuple[Proposal, ...] = ()
    decisions: tuple[Decision, ...] = ()
    launches: tuple[Launch, ...] = ()
    results: tuple[ExperimentResult, ...] = ()
    code: tuple[CodeVersion, ...] = ()  # one CodeVersion per code proposal
    swaps: tuple[SwapResult, ...] = ()
    live: Launch | None = None  # the live run; the state's {} when there is none
    tokens_used: int = 0  # LLM tokens the planner spent: with the launches and the live run, what `spent` counts

    @field_validator("live", mode="before")
    @classmethod
    def _no_live_is_none(cls, value: Any) -> Any:
        return value or None

    @classmethod
    def read(cls, state: Mapping[str, Any]) -> StudyRecords:
        """The records of `state`, each validated once; StudyStateError names every field that broke."""
        return cls._validated(state, {})

    @classmethod
    def _validated(cls, state: Mapping[str, Any], extra: dict[str, Any]) -> Any:
        raw = {k: state[k] for k in RECORD_FIELDS if state.get(k) is not None}
        try:
            return cls.model_validate({**raw, **extra})
        except ValidationError as e:
            broken = "; ".join(f"{_where(err['loc'])}: {err['msg']}" for err in e.errors())
            raise StudyStateError(f"the study's state has records that do not validate: {broken}") from None

    def proposal(self, proposal_id: str) -> Proposal | None:
        return next((p for p in self.proposals if p.id == proposal_id), None)

    def result_of(self, proposal_id: str) -> ExperimentResult | None:
        return next((r for r in self.results if r.proposal_id == proposal_id), None)

    def spent(self, gpus: int = 0, now: float | None = None) -> Spent:
        """What the study has spent (`gpus`: the brief's `launch.gpus`, GPUs per run)."""
        return Spent.counted(self.launches, self.live, self.tokens_used, now, gpus)

    @property
    def current(self) -> list[Proposal]:
        """The proposals of the round being run."""
        return [p for p in self.proposals if p.round == self.round]

    @property
    def verdicts(self) -> dict[str, Decision]:
        """Each decided proposal's decision (approved or vetoed), by proposal id."""
        return {d.proposal_id: d for d in self.decisions}

    @property
    def versions(self) -> dict[str, CodeVersion]:
        """Each code proposal's code version, by proposal id."""
        return {v.proposal_id: v for v in self.code}


