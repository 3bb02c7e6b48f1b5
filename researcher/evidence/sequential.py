"""Group-sequential boundaries: how much of the error rate each look at a growing comparison may spend.

A study that adds seeds to an inconclusive comparison in stages looks at the same comparison again
and again; testing every look at `ALPHA` would call a null change better far more often than
`ALPHA / 2`. A group-sequential test fixes, before the first look, the most looks it may take
(`looks`) and spends the error rate across them with an error-spending function alpha(t) of the
information fraction t (the seeds so far over the seeds at the last planned look), after
Lan & DeMets (1983), "Discrete sequential boundaries for clinical trials", Biometrika 70(3), 659-663:

- O'Brien–Fleming type, alpha(t) = 2 - 2 Phi(z_{1-alpha/2} / sqrt t): almost nothing early, nearly the
  whole alpha at the last look (O'Brien & Fleming 1979, Biometrics 35, 549-556). The default: a
  comparison that runs to its last look loses almost no power against a fixed test of that size.
- Pocock type, alpha(t) = alpha ln(1 + (e - 1) t): about the same level at every look (Pocock 1977,
  Biometrika 64, 191-199), so it stops earlier on a large effect, at the price of the last look.

The boundary c_k of look k is the two-sided z value such that a null comparison crosses at look k
(and at no earlier look) with probability alpha(t_k) - alpha(t_{k-1}), found by integrating the
density of the score statistic over the continuation region look after look (the recursion of
Armitage, McPherson & Rowe 1969; Jennison & Turnbull 2000, "Group Sequential Methods with
Applications to Clinical Trials", ch. 19). Each look is then judged by the ordinary t-test's p-value
against the look's nominal level 2(1 - Phi(c_k)): with few seeds the variance is estimated, and
Jennison & Turnbull (ch. 3) show that nominal levels carried over to t-tests keep the error rate
close to the design's. `bench/rigor.py` measures it on simulated studies.

Fewer looks than planned (the budget ran out) spend less than alpha: the test stays valid, only
conservative. This module is numbers only: it decides no verdict and plans no seeds
(`researcher.evidence.replication` does).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Literal

import numpy as np

from researcher.lazy import lazy_module

# scipy.stats loads with the first boundary, not with every `researcher` command (see analysis.py).
stats = lazy_module("scipy.stats")
optimize = lazy_module("scipy.optimize")

Boundary = Literal["obrien_fleming", "pocock"]
# Grid points per unit of the score's standard deviation in the numerical integration: at 40 the
# boundaries agree with published tables to the third decimal (tests/researcher/test_sequential.py).
GRID_PER_SD = 40
# The integration's range in standard deviations of the score: beyond 8 the normal density is < 1e-14.
GRID_SD = 8.0


def spent(t: float, alpha: float, boundary: Boundary) -> float:
    """The two-sided error rate a design may have spent by information fraction t (0 < t <= 1)."""
    t = min(max(t, 0.0), 1.0)
    if t == 0.0:
        return 0.0
    if boundary == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    z = float(stats.norm.ppf(1.0 - alpha / 2.0))
    return float(2.0 - 2.0 * stats.norm.cdf(z / math.sqrt(t)))


@functools.lru_cache(maxsize=256)
def boundaries(fractions: tuple[float, ...], alpha: float, boundary: Boundary) -> tuple[float, ...]:
    """The two-sided z boundaries c_1..c_K at increasing information fractions (the last is 1)."""
    if not fractions or any(b <= a for a, b in itertools.pairwise(fractions)) or fractions[0] <= 0:
        raise ValueError(f"information fractions must increase from above 0: {fractions}")
    if not math.isclose(fractions[-1], 1.0):
        raise ValueError(f"the last look must be at information fraction 1, not {fractions[-1]}")
    norm = stats.norm
    out: list[float] = []
    grid: np.ndarray | None = None  # score values s = Z sqrt(t) in the continuation region
    density: np.ndarray | None = None  # sub-density of the score there (not yet stopped)
    previous_t, previous_spent = 0.0, 0.0
    for t in fractions:
        target = spent(t, alpha, boundary) - previous_spent
        step = t - previous_t  # variance of the score's increment since the last look
        if grid is None or density is None:
            c = float(norm.ppf(1.0 - target / 2.0))
        else:
            weights = density * np.gradient(grid)  # trapezoid-like weights on a uniform grid

            def crossing(c: float, g: np.ndarray = grid, w: np.ndarray = weights, t: float = t,
                         sd: float = math.sqrt(step), target: float = target) -> float:
                """Null probability of crossing at this look (not before), minus what it may spend."""
                edge = c * math.sqrt(t)
                return float(np.sum(w * (norm.sf((edge - g) / sd) + norm.cdf((-edge - g) / sd)))) - target

            # Nothing left to spend (a flat spending function): the boundary is at the grid's edge.
            c = GRID_SD / math.sqrt(t) if target <= 0 else float(optimize.brentq(crossing, 1e-6, GRID_SD * 2))
        out.append(c)
        edge = c * math.sqrt(t)
        points = max(int(2 * edge * GRID_PER_SD / math.sqrt(t)) | 1, 101)
        new_grid = np.linspace(-edge, edge, points)
        if grid is None or density is None:
            new_density = norm.pdf(new_grid / math.sqrt(t)) / math.sqrt(t)
        else:
            kernel = norm.pdf((new_grid[:, None] - grid[None, :]) / math.sqrt(step)) / math.sqrt(step)
            new_density = kernel @ (density * np.gradient(grid))
        grid, density = new_grid, new_density
        previous_t, previous_spent = t, previous_spent + target
    return tuple(out)


def nominal_levels(planned: tuple[int, ...], alpha: float, boundary: Boundary) -> tuple[float, ...]:
    """The two-sided nominal p-value of each look, given the seeds per arm planned at each look
    (increasing; the last is the most the design may reach)."""
    if not planned or any(n < 1 for n in planned):
        raise ValueError(f"a design needs at least one look, each with seeds: {planned}")
    fractions = tuple(n / planned[-1] for n in planned)
    return tuple(float(2.0 * stats.norm.sf(c)) for c in boundaries(fractions, alpha, boundary))
