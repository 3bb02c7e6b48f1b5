"""The curves plot's series: each labelled with what it changed, the baseline and confirmations drawn apart."""

from __future__ import annotations

from researcher.records import Proposal
from researcher.review.report import curve_series

BASE = {"trainer.lr": "0.01", "trainer.steps": "2"}
CURVE = [(1, 0.1), (2, 0.2)]


def _proposal(pid: str, **kw) -> Proposal:
    return Proposal(id=pid, round=1, planner="heuristic", hypothesis="a higher lr learns faster", rationale="r r",
                    expected_effect="e e", **kw)


def test_labels_say_what_changed_and_baseline_and_confirmation_are_drawn_apart() -> None:
    proposals = {"r1-1": _proposal("r1-1"), "r1-2": _proposal("r1-2", overrides={"trainer.lr": 0.03}),
                 "r2-1": _proposal("r2-1", overrides={"trainer.lr": 0.03}, confirms="r1-2"),
                 "r1-3": _proposal("r1-3", patch="--- a/x\n+++ b/x\n", commit="abcdef1234")}
    series = {s.label: s for s in curve_series({pid: CURVE for pid in proposals}, proposals, {}, BASE)}
    assert set(series) == {"r1-1: baseline", "r1-2: trainer.lr=0.03", "r2-1: trainer.lr=0.03 (confirmation)",
                           "r1-3: a higher lr learns faster @ abcdef1"}
    assert (series["r1-1: baseline"].color, series["r1-1: baseline"].width) == ("black", 2.5)
    assert series["r1-2: trainer.lr=0.03"].color is None and series["r1-2: trainer.lr=0.03"].style == "-"
    assert series["r2-1: trainer.lr=0.03 (confirmation)"].style == "--"


def test_a_curve_whose_proposal_is_gone_is_still_drawn_under_its_id() -> None:
    [only] = curve_series({"r9-9": CURVE}, {}, {}, BASE)
    assert (only.label, only.curve, only.color) == ("r9-9", CURVE, None)
