"""Group-sequential boundaries (researcher.evidence.sequential): a design of K looks errs at alpha overall."""

from __future__ import annotations

import math

import numpy as np
import pytest

from researcher.evidence import sequential

LOOKS = (0.25, 0.5, 0.75, 1.0)


def null_crossing(bounds: tuple[float, ...], fractions: tuple[float, ...], trials: int = 200_000) -> float:
    """How often a null comparison (Brownian motion observed at `fractions`) crosses a boundary at any look."""
    rng = np.random.default_rng(0)
    steps = np.diff((0.0, *fractions))
    score = np.cumsum(rng.normal(size=(trials, len(fractions))) * np.sqrt(steps), axis=1)
    z = score / np.sqrt(fractions)
    return float((np.abs(z) >= np.array(bounds)).any(axis=1).mean())


@pytest.mark.parametrize("boundary", ["obrien_fleming", "pocock"])
def test_a_design_errs_at_alpha_over_all_its_looks(boundary: str) -> None:
    bounds = sequential.boundaries(LOOKS, 0.05, boundary)  # type: ignore[arg-type]
    assert null_crossing(bounds, LOOKS) == pytest.approx(0.05, abs=0.003)
    testing_each_look_at_alpha = null_crossing((1.96,) * 4, LOOKS)
    assert testing_each_look_at_alpha > 0.1  # what the design prevents


def test_obrien_fleming_spends_little_early_and_its_first_look_is_the_closed_form() -> None:
    bounds = sequential.boundaries(LOOKS, 0.05, "obrien_fleming")
    assert bounds[0] == pytest.approx(1.959964 / math.sqrt(0.25), abs=1e-4)  # alpha(t) = 2 - 2 Phi(z / sqrt t)
    assert list(bounds) == sorted(bounds, reverse=True) and bounds[-1] < 2.1  # little lost at the last look
    levels = sequential.nominal_levels((3, 6, 9, 12), 0.05, "obrien_fleming")
    assert levels[0] < 1e-3 and 0.03 < levels[-1] < 0.05
    pocock = sequential.nominal_levels((3, 6, 9, 12), 0.05, "pocock")
    assert max(pocock) - min(pocock) < 0.005  # about the same level at every look
    assert sequential.nominal_levels((5,), 0.05, "obrien_fleming") == pytest.approx((0.05,))  # one look: fixed


def test_bad_designs_are_refused() -> None:
    with pytest.raises(ValueError, match="increase"):
        sequential.boundaries((0.5, 0.5, 1.0), 0.05, "pocock")
    with pytest.raises(ValueError, match="fraction 1"):
        sequential.boundaries((0.5, 0.9), 0.05, "pocock")
    with pytest.raises(ValueError, match="at least one look"):
        sequential.nominal_levels((), 0.05, "pocock")
