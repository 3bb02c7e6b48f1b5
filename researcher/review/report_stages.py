"""The report's table of replication stages: each look at a comparison that bought more seeds.

A comparison that was inconclusive got held-out seeds in stages (researcher/evidence/stages.py);
every look was judged at the nominal level of its group-sequential design. This renders each look's
evidence (seeds, effect with CI, p, the level it had to beat, the result) so a reader sees how the
verdict was reached, not only where it ended. It decides nothing and reads nothing but the results.
"""

from __future__ import annotations

from collections.abc import Mapping

from researcher.records import ExperimentResult, Verdict

EXPLAINED = ("An inconclusive comparison got held-out seeds in stages, for the candidate and its reference alike. "
             "Each look is judged at its nominal level under an error-spending design planned before its looks "
             "(the confirmation's when it started; a search comparison's at its first added stage), so a null "
             "change is confirmed better at most alpha/2 of the time however many looks it took. "
             "Look 1 of a search comparison is its round's fixed-size test.")


def _row(pid: str, kind: str, index: int, v: Verdict) -> str:
    effect = (f"{v.effect:+.4g} [{v.ci[0]:+.4g}, {v.ci[1]:+.4g}]" if v.effect is not None and v.ci else
              f"{v.effect:+.4g}" if v.effect is not None else "-")
    p = v.p_adjusted if v.p_adjusted is not None else v.p
    level = f"{v.level:.3g}" if v.level is not None else "0.05 (fixed)"
    return (f"| {pid} | {kind} | {v.look or index} of {v.looks or '-'} | {v.n} vs {v.n_baseline} | {effect} | "
            f"{'-' if p is None else f'{p:.3g}'} | {level} | {v.result} |")


def stage_lines(results: Mapping[str, ExperimentResult]) -> list[str]:
    """The report section, or nothing when no comparison added seeds."""
    rows = []
    for pid, r in results.items():
        for kind, looks in (("search", r.stages), ("confirmation", r.confirmation.stages if r.confirmation else [])):
            rows += [_row(pid, kind, i, v) for i, v in enumerate(looks, start=1)]
    if not rows:
        return []
    return ["## Seeds added in stages", "", EXPLAINED, "",
            ("| proposal | comparison | look | seeds (candidate vs reference) | effect [95% CI] | p | level to beat "
             "| result |"), "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, ""]
