"""How two arms' seeds pair up for a test: pooled over replication stages, aligned at plateau stops.

- An arm's scores are pooled over its line (the arm and the stages that added seeds to it), so a
  look at a group-sequential comparison sees every seed so far.
- A seed one arm stopped for a plateau at step k is scored at step k in *both* arms of the
  comparison (`score_at` reads the other arm's run there). Dropping it instead would bias the arm
  whose good seeds converge early, and scoring only that arm early would compare step k with the
  last step. Without `score_at`, or when a run has no value at k, the seed leaves both arms, and
  the note says so.
- Only seeds both arms finished pair up: the paired test then runs on them (`decision.compare`).

Pure functions over results; it reads nothing itself (`score_at` is the caller's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from researcher.records import ExperimentResult

# (proposal id, seed, trainer step) -> that run's score at the step, or None when it cannot be read.
ScoreAt = Callable[[str, int, int], "float | None"]


@dataclass
class Arm:
    """One side of a comparison: seed -> score, who ran it, and where a plateau stopped it."""

    scores: dict[int, float] = field(default_factory=dict)
    owner: dict[int, str] = field(default_factory=dict)  # seed -> the proposal whose run it is
    stopped: dict[int, int] = field(default_factory=dict)  # seed -> plateau stop step
    failed: dict[int, str] = field(default_factory=dict)  # seed -> why it has no score

    @property
    def seeds(self) -> list[int]:
        return sorted(self.owner)


def arm(results: Sequence[ExperimentResult]) -> Arm:
    """An arm pooled over the results of its line (stages hold different seeds)."""
    out = Arm()
    for r in results:
        out.scores.update(r.seed_scores)
        out.owner.update({s: r.proposal_id for s in [*r.seed_scores, *r.failed_seeds]})
        out.stopped.update(r.stopped_at)
        out.failed.update(r.failed_seeds)
    return out


def aligned(candidate: Arm, reference: Arm, score_at: ScoreAt | None) -> tuple[dict[int, float], dict[int, float], str]:
    """(candidate scores, reference scores, note): every seed a plateau stopped in either arm scored at
    the earlier stop step in both."""
    cand, ref = dict(candidate.scores), dict(reference.scores)
    dropped: list[int] = []
    moved: list[str] = []
    for seed in sorted(set(candidate.stopped) | set(reference.stopped)):
        if seed not in cand or seed not in ref:
            continue
        step = min(candidate.stopped.get(seed, 1 << 62), reference.stopped.get(seed, 1 << 62))
        values = []
        for side, scores in ((candidate, cand), (reference, ref)):
            if side.stopped.get(seed) == step:
                values.append(scores[seed])  # scored at its own stop already
            else:
                values.append(score_at(side.owner[seed], seed, step) if score_at is not None else None)
        if any(v is None for v in values):
            dropped.append(seed)
            cand.pop(seed)
            ref.pop(seed)
        else:
            cand[seed], ref[seed] = values  # type: ignore[assignment]
            moved.append(f"{seed}@{step}")
    notes = []
    if moved:
        notes.append(f"seeds stopped at a plateau scored at the same step in both arms: {', '.join(moved)}")
    if dropped:
        notes.append(f"seeds {dropped} stopped at a plateau left out of both arms (no score at the stop step)")
    return cand, ref, "; ".join(notes)
