"""The decision rule: is a candidate better than the baseline, given per-seed scores?

Every candidate is compared with the baseline trained on the same seeds, steps and base config.
- The scores pair up by seed (the same seed gives the same initial weights and task order), and the
  test is a paired t-test on the per-seed differences over the seeds *both* finished: a seed one arm
  lost leaves the pair, never the pairing (Welch's test on the rest would throw away what the seeds share).
- Only when fewer than two seeds pair up is the test Welch's t-test, which assumes neither equal
  variances nor equal counts.
The verdict is `better` or `worse` when the two-sided test rejects "no difference" at `ALPHA`
(after Holm–Bonferroni across a round's candidates), `inconclusive` when it does not or cannot
(fewer than two finished seeds on a side, or no variance to estimate noise from), and
`incomplete` when a seed failed twice. It always carries the effect (difference of means,
candidate minus baseline), its 95% confidence interval, the p-value and the test's name.

The in-run A/B of a hot swap, whose steps are not independent, is judged by its own test
(`researcher.evidence.ab`), which reuses `holm` and the verdict's shape from here.

Which candidate the study recommends, and whether a confirmation on held-out seeds replicated
it, are decided here too. Pure functions over numbers and records: no MLflow, no files, no
processes. The distributions come from scipy, not from hand-written approximations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel

from researcher.records import Confirmation, Result, Verdict

# The error rate of one round's "better"/"worse" claims: a two-sided 5% test, so a null change
# is called better at most 2.5% of the time, and Holm keeps that per round, not per candidate.
ALPHA = 0.05
# The confidence level of the effect's interval; matches ALPHA so "CI excludes 0" <=> "p < ALPHA".
CONFIDENCE = 1 - ALPHA
# Fewer finished seeds than this on either side cannot estimate noise: never better or worse.
MIN_SEEDS = 2

PAIRED = "paired t-test"
WELCH = "Welch's t-test"
NO_TEST = "none"

Direction = Literal["maximize", "minimize"]



def _finite(scores: Mapping[int, float]) -> dict[int, float]:
    return {s: float(v) for s, v in scores.items() if v is not None and math.isfinite(v)}


def _good(effect: float, direction: Direction) -> bool:
    return effect > 0 if direction == "maximize" else effect < 0


def compare(candidate: Mapping[int, float], baseline: Mapping[int, float], direction: Direction, *,
            baseline_id: str | None = None, incomplete: str = "", alpha: float = ALPHA) -> Verdict:
    """The verdict of one candidate against the baseline from per-seed scores (seed -> score).

    NaN or infinite scores count as not finished. `incomplete` names seeds that failed even after
    their re-run: the verdict is then `incomplete`, whatever the numbers say, but keeps them.
    """
    cand, base = _finite(candidate), _finite(baseline)
    common = sorted(set(cand) & set(base))
    head = dict(n=len(cand), n_baseline=len(base), baseline=baseline_id)
    if len(cand) < MIN_SEEDS or len(base) < MIN_SEEDS:
        short = [f"{what} has {k} finished seed{'s' if k != 1 else ''}"
                 for what, k in (("the candidate", len(cand)), ("the baseline", len(base))) if k < MIN_SEEDS]
        reason = "; ".join(short) + f": at least {MIN_SEEDS} per side are needed to estimate noise"
        effect = (float(np.mean(list(cand.values())) - np.mean(list(base.values())))
                  if cand and base else None)
        return Verdict(result="incomplete" if incomplete else "inconclusive", test=NO_TEST, effect=effect,
                       reason=f"{incomplete}; {reason}" if incomplete else reason, **head)
    # Imported here, not at the top: scipy.stats costs seconds of start-up, and every `researcher`
    # command loads this module (through researcher.records) while only a verdict with numbers uses it.
    from scipy import stats

    paired = len(common) >= MIN_SEEDS
    if paired and set(cand) != set(base):
        head.update(n=len(common), n_baseline=len(common))  # what the test saw: the seeds both finished
    if paired:
        a = np.array([cand[s] for s in common])
        b = np.array([base[s] for s in common])
        diffs = a - b
        test, effect, spread = PAIRED, float(diffs.mean()), float(diffs.std(ddof=1))
        raw = stats.ttest_rel(a, b) if spread > 0 else None
    else:
        a, b = np.array(list(cand.values())), np.array(list(base.values()))
        test, effect = WELCH, float(a.mean() - b.mean())
        spread = float(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
        raw = stats.ttest_ind(a, b, equal_var=False) if spread > 0 else None
    if raw is None:
        # Identical differences (or constant scores) leave no noise estimate: a t-test would divide
        # by zero and call any offset certain. Quantised rewards on few seeds do this; say so.
        reason = "the scores do not vary across seeds, so the test cannot estimate noise"
        return Verdict(result="incomplete" if incomplete else "inconclusive", test=test, effect=effect,
                       ci=[effect, effect], p=None if effect else 1.0,
                       reason=f"{incomplete}; {reason}" if incomplete else reason, **head)
    interval = raw.confidence_interval(confidence_level=CONFIDENCE)
    p = float(raw.pvalue)
    verdict = Verdict(result="inconclusive", test=test, effect=effect,
                      ci=[float(interval.low), float(interval.high)], p=p, **head)
    return _judge(verdict, p, direction, alpha, incomplete)


def _judge(verdict: Verdict, p: float, direction: Direction, alpha: float, incomplete: str,
           note: str = "") -> Verdict:
    """Set result and reason from a (possibly adjusted) p-value."""
    assert verdict.effect is not None
    if incomplete:
        return verdict.model_copy(update={"result": "incomplete", "reason": incomplete})
    if p < alpha:
        result: Result = "better" if _good(verdict.effect, direction) else "worse"
        return verdict.model_copy(update={"result": result, "reason": ""})
    why = f"p={p:.3g} is not below {alpha}" + (f" {note}" if note else "")
    return verdict.model_copy(update={"result": "inconclusive", "reason": why})


def holm(verdicts: Mapping[str, Verdict], direction: Direction, alpha: float = ALPHA) -> dict[str, Verdict]:
    """Holm–Bonferroni across one round's candidates: the round, not each candidate, errs at `alpha`.

    Verdicts without a p-value pass through unchanged; the others get `p_adjusted` and their
    result judged on it (an incomplete verdict stays incomplete).
    """
    tested = sorted(((v.p, k) for k, v in verdicts.items() if v.p is not None), key=lambda t: t[0])
    out = dict(verdicts)
    m = len(tested)
    running = 0.0
    for rank, (p, key) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))  # step-down adjusted p, kept monotone
        v = verdicts[key].model_copy(update={"p_adjusted": running})
        incomplete = v.reason if v.result == "incomplete" else ""
        out[key] = _judge(v, running, direction, alpha, incomplete,
                          note=f"after Holm–Bonferroni over {m} candidates" if m > 1 else "")
    return out


def judge_round(candidates: Mapping[str, Mapping[int, float]], baseline: Mapping[int, float] | None,
                direction: Direction, *, baseline_id: str | None = None,
                incomplete: Mapping[str, str] | None = None, alpha: float = ALPHA) -> dict[str, Verdict]:
    """Every candidate of a round against the one baseline, corrected together."""
    incomplete = incomplete or {}
    if baseline is None:
        return {k: Verdict(result="incomplete" if incomplete.get(k) else "inconclusive", test=NO_TEST,
                           n=len(_finite(v)), reason="no baseline was run with the same steps and seeds")
                for k, v in candidates.items()}
    raw = {k: compare(v, baseline, direction, baseline_id=baseline_id, incomplete=incomplete.get(k, ""),
                      alpha=alpha) for k, v in candidates.items()}
    return holm(raw, direction, alpha)


def held_out_seeds(used: Sequence[int], count: int) -> list[int]:
    """`count` seeds the search never used: the next integers above every seed used so far."""
    start = max(used, default=-1) + 1
    return list(range(start, start + count))


class Candidate(BaseModel):
    """What `recommend` needs of one scored experiment."""

    proposal_id: str
    steps: int  # trainer steps it was trained for
    verdict: Verdict | None = None  # None for the baseline itself
    mean: float = math.nan
    parent: str | None = None  # the proposal whose code it builds on (a chain), None for one on the base
    parent_verdict: Verdict | None = None  # against its parent's code with its own config

    def adds_nothing(self) -> bool:
        """A chained candidate not judged better than its parent: what it adds to the parent's code is not
        shown to help, so it is never recommended in the parent's place (a hostile or no-effect addition would
        otherwise ride on a good parent, issue 38 item 5)."""
        return self.parent is not None and (self.parent_verdict is None or self.parent_verdict.result != "better")


def recommend(candidates: Sequence[Candidate], direction: Direction) -> Candidate | None:
    """The experiment a study may recommend: `better` than the baseline at the longest training, and, for
    a chained one, better than its parent too.

    Only the longest-trained experiments compete (a score after more steps is not comparable with
    one after fewer); among those judged `better` (and not `adds_nothing`), the largest effect in the
    objective's direction. So a child that is no better than its parent leaves the parent as the pick.
    None when no experiment beat the baseline.
    """
    judged = [c for c in candidates if c.verdict is not None]
    if not judged:
        return None
    longest = max(c.steps for c in judged)
    winners = [c for c in judged if c.steps == longest and c.verdict is not None and c.verdict.result == "better"
               and not c.adds_nothing()]
    if not winners:
        return None
    sign = 1.0 if direction == "maximize" else -1.0
    return max(winners, key=lambda c: sign * (c.verdict.effect or 0.0) if c.verdict else 0.0)


def confirm(proposal_id: str, seeds: Sequence[int], candidate: Mapping[int, float],
            baseline: Mapping[int, float], direction: Direction, *, baseline_id: str | None = None,
            incomplete: str = "", alpha: float = ALPHA) -> Confirmation:
    """Judge the confirmation round: the recommendation stands only if it is `better` again."""
    verdict = compare(candidate, baseline, direction, baseline_id=baseline_id, incomplete=incomplete, alpha=alpha)
    return Confirmation(proposal_id=proposal_id, seeds=list(seeds), verdict=verdict,
                        replicated=verdict.result == "better")
