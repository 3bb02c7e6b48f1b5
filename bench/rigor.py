"""Rigor benchmark: how often the study's decision rule finds a real effect and keeps a null one.

The objective is simulated: each "run" scores the baseline plus the effect planted in its
configuration plus Gaussian seed noise of standard deviation sigma, independent per run (the
worst case for a paired test: real runs sharing a seed are positively correlated, which helps it).
Everything else is the study's real code, not a copy:
- the heuristic planner (successive halving, brief defaults: 4 arms, eta 2) proposes, and
  `researcher.evidence.baselines.needed` adds the baseline arms the plan node adds;
- `researcher.evidence.analysis` turns runs into per-seed scores and verdicts (`experiment_result`, `judge`);
- `researcher.evidence.confirmation` picks the recommendation and builds its confirmation round on held-out
  seeds, judged by the same `analysis.judge`.
The search space is one choice of four learning rates: the baseline, one arm with the planted
effect, and two null arms.

Per planted effect (0, 1, 2 and 3 sigma) and per seed count it runs several hundred studies and
prints detection (the planted arm judged `better` in the search, and recommended after a
confirmation that replicated) and false keeps (a null arm judged `better`, or recommended).

The in-run A/B of a hot swap (`ab_table`) is judged by the study's own
`researcher.evidence.decision.judge_ab` on simulated per-step rewards of a learning run: a shared drifting
curve and the weights' autocorrelated wander, common to both versions at a step, plus each
version's episode noise. It prints A/B detection and false keeps per effect and window, beside the
before/after verdict the A/B replaced. The last line holds the figures for the brief's defaults:

    rigor: detection_2sigma=<x> false_keep=<y> ab_detection=<a> ab_false_keep=<b> seeds=<n>

with false_keep the rate at which a study of null changes ends recommending one, ab_detection the
rate a 2-sigma swap is called better, ab_false_keep the rate a null swap is (and so kept).

    .venv/bin/python bench/rigor.py [--studies 300] [--seeds 3 5] [--sigma 1.0] [--ab-trials 400] [--live-trials 3]

`--live-trials N` (`bench/rigor_live.py`) also makes N real null A/B swaps and one planted one into
a live tiny run and judges them with the same code; they are printed, and not part of the last line.

Without `--live-trials` it launches no core run and touches no MLflow: the point is the statistics of the decisions.
"""

from __future__ import annotations

import argparse
import random
import time

import rigor_live  # bench/rigor_live.py, beside this script

from researcher.brief.loader import parse_brief
from researcher.brief.schema import Brief
from researcher.evidence import analysis, baselines, confirmation, decision
from researcher.planner.heuristic import HeuristicPlanner
from researcher.planner.types import PlanContext
from researcher.records import Decision, ExperimentResult, Launch, Proposal

BASE_LR, PLANTED_LR, NULL_LRS = 3.0e-3, 3.0e-2, (1.0e-3, 1.0e-2)
BASE_STEPS = 8
BASE_SCORE = 0.5
EFFECTS = (0.0, 1.0, 2.0, 3.0)  # planted effect in units of sigma
# Runaway guard: successive halving over 4 arms ends in 3 rounds; more means the planner looped.
MAX_ROUNDS = 20

BRIEF = """---
objective: {{metric: reward/mean, direction: maximize}}
run: {{base_config: configs/tiny.yaml}}
search_space:
  trainer.lr: {{kind: choice, values: [{base}, {planted}, {null0}, {null1}]}}
{seeds}
---
"""


def make_brief(seeds: int | None) -> Brief:
    text = BRIEF.format(base=BASE_LR, planted=PLANTED_LR, null0=NULL_LRS[0], null1=NULL_LRS[1],
                        seeds="" if seeds is None else f"seeds: {seeds}")
    return parse_brief(text, "<rigor>")


def simulate_study(brief: Brief, effect: float, sigma: float, rng: random.Random) -> dict[str, bool]:
    """One study from first plan to confirmation; what it concluded about the planted and null arms."""
    base_values = {"trainer.lr": BASE_LR}
    objective = brief.objective

    def runs(p: Proposal, seeds: list[int]) -> ExperimentResult:
        planted = effect * sigma if p.overrides.get("trainer.lr") == PLANTED_LR else 0.0
        steps = int(p.overrides.get("trainer.steps", BASE_STEPS))
        launches = [Launch(key=f"{p.id}-s{s}", proposal_id=p.id, seed=s, steps=steps, status="finished") for s in seeds]
        outcomes = {x.key: analysis.RunScore(BASE_SCORE + planted + rng.gauss(0.0, sigma)) for x in launches}
        return analysis.experiment_result(p.id, launches, outcomes)

    planner = HeuristicPlanner()
    proposals: list[Proposal] = []
    decisions: list[Decision] = []
    results: list[ExperimentResult] = []
    for number in range(1, MAX_ROUNDS + 1):
        ctx = PlanContext(brief=brief, base_values=base_values, base_steps=BASE_STEPS, round=number,
                          proposals=list(proposals), decisions=list(decisions), results=list(results),
                          runs_left=10**6, steps_left=10**9)
        plan = planner.plan(ctx)
        if plan.done:
            break
        fresh = [Proposal(**item.draft.model_dump(), id=f"r{number}-{i}", round=number, planner="heuristic",
                          arm=item.arm, rung=item.rung) for i, item in enumerate(plan.planned, start=1)]
        fresh += baselines.needed(fresh, proposals, decisions, base_values, BASE_STEPS, number)  # as the plan node does
        proposals += fresh
        decisions += [Decision(proposal_id=p.id, verdict="approved", by="policy") for p in fresh]
        new = [runs(p, brief.seeds) for p in fresh]
        results += analysis.judge(new, proposals, base_values, BASE_STEPS, objective, known=results)
    else:
        raise RuntimeError("the planner did not finish within the round guard")

    by_id = {p.id: p for p in proposals}
    longest: dict[float, ExperimentResult] = {}
    for r in results:
        longest[by_id[r.proposal_id].overrides.get("trainer.lr", BASE_LR)] = r  # in round order: the last is the longest
    searched_better = {lr for lr, r in longest.items() if r.verdict is not None and r.verdict.result == "better"}
    pick = confirmation.owed(proposals, results, BASE_STEPS, brief)
    if pick is not None:
        result = next(r for r in results if r.proposal_id == pick.id)
        fresh = confirmation.proposals_for(pick, result, proposals, brief, base_values, BASE_STEPS, number)
        proposals += fresh
        new = [runs(p, p.seeds or []) for p in fresh]
        results += analysis.judge(new, proposals, base_values, BASE_STEPS, objective, known=results)
        results = confirmation.attach(results, proposals, base_values)
    found = confirmation.search_recommendation(proposals, results, BASE_STEPS, brief)
    kept = None
    if found is not None and found[1].confirmation is not None and found[1].confirmation.replicated:
        kept = found[0].overrides.get("trainer.lr", BASE_LR)
    return {"search_detect": PLANTED_LR in searched_better,
            "search_false": any(lr in searched_better for lr in NULL_LRS) or (effect == 0 and PLANTED_LR in searched_better),
            "detect": kept == PLANTED_LR,
            "false_keep": kept in NULL_LRS or (effect == 0 and kept == PLANTED_LR)}


# -- the in-run A/B ------------------------------------------------------------------------------
AB_EFFECTS = (0.0, 1.0, 2.0, 3.0)  # in units of sigma, the std of one version's per-step reward
AB_WINDOWS = (5, 10, 20)  # besides the brief's default `run.swap_window`
# One version's per-step reward around the curve: the weights' AR(1) wander (shared by both versions at
# a step: same weights) and the version's own episode noise, splitting sigma^2 0.36 : 0.64.
AB_PHI, AB_WANDER, AB_EPISODE = 0.8, 0.6, 0.8
AB_PRE = 20  # steps the old version trains alone before the swap (the before/after verdict's "before")
AB_RISE = (0.05, 0.15)  # the learning curve's slope per step, in sigma, drawn per trial: a drifting run


def ab_trial(effect: float, window: int, direction: decision.Direction, rng: random.Random) -> tuple[str, str]:
    """One simulated swap on a learning run; -> (A/B verdict, before/after verdict) of the new version."""
    sign = 1.0 if direction == "maximize" else -1.0
    slope = rng.uniform(*AB_RISE)
    innovation = AB_WANDER * (1 - AB_PHI**2) ** 0.5  # stationary std AB_WANDER
    wander = rng.gauss(0.0, AB_WANDER)
    old: dict[int, float] = {}
    new: dict[int, float] = {}
    for t in range(AB_PRE + window):
        wander = AB_PHI * wander + rng.gauss(0.0, innovation)
        shared = sign * slope * t + wander  # the run learns in the objective's direction
        old[t] = shared + rng.gauss(0.0, AB_EPISODE)
        if t >= AB_PRE:
            new[t] = shared + sign * effect + rng.gauss(0.0, AB_EPISODE)
    ab = decision.judge_ab(new, old, direction, baseline_id="old")  # the study's own A/B verdict (nodes/live.py)
    before = {t: v for t, v in old.items() if AB_PRE - window <= t < AB_PRE}
    return ab.result, decision.compare(new, before, direction).result


def ab_table(trials: int, default_window: int, direction: decision.Direction, seed: int) -> dict[str, float]:
    """Print A/B detection and false keeps per effect and window; -> those at the brief's default window."""
    windows = [default_window] + [w for w in AB_WINDOWS if w != default_window]
    print(f"in-run A/B: {trials} simulated swaps per cell on learning runs (slope {AB_RISE[0]}-{AB_RISE[1]} sigma "
          f"per step, shared AR({AB_PHI}) wander {AB_WANDER} sigma, episode noise {AB_EPISODE} sigma); "
          f"decision.judge_ab; brief default swap_window {default_window}")
    print("| window | effect | A/B better | before/after better |")
    print("| --- | --- | --- | --- |")
    headline: dict[str, float] = {}
    for window in windows:
        for effect in AB_EFFECTS:
            rng = random.Random(f"ab-{seed}-{window}-{effect}")
            results = [ab_trial(effect, window, direction, rng) for _ in range(trials)]
            ab = sum(r[0] == "better" for r in results) / trials
            before_after = sum(r[1] == "better" for r in results) / trials
            print(f"| {window}{' (default)' if window == default_window else ''} | {effect:g}σ | {ab:.3f} "
                  f"| {before_after:.3f} |", flush=True)
            if window == default_window and effect == 2.0:
                headline["detect"] = ab
            if window == default_window and effect == 0.0:
                headline["false_keep"] = ab
    return headline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--studies", type=int, default=300, help="simulated studies per (effect, seeds) cell")
    ap.add_argument("--seeds", type=int, nargs="*", default=[3, 5], help="seed counts besides the brief's default")
    ap.add_argument("--sigma", type=float, default=1.0, help="seed noise (std of one run's score)")
    ap.add_argument("--rng", type=int, default=0, help="seeds the simulated noise")
    ap.add_argument("--ab-trials", type=int, default=400, help="simulated swaps per A/B cell (at least 40)")
    ap.add_argument("--live-trials", type=int, default=0, help="real null A/B swaps into a live tiny run")
    args = ap.parse_args()
    default = make_brief(None)
    counts = [len(default.seeds)] + [n for n in args.seeds if n != len(default.seeds)]
    print(f"rigor: {args.studies} simulated studies per cell; sigma {args.sigma}; independent noise per run; "
          f"alpha {decision.ALPHA}; brief default seeds {len(default.seeds)}")
    print("| seeds | effect | detection (search) | detection (confirmed) | false keep (search) | false keep (kept) |")
    print("| --- | --- | --- | --- | --- | --- |")
    started = time.time()
    headline: dict[str, float] = {}
    for n in counts:
        brief = default if n == len(default.seeds) else make_brief(n)
        for effect in EFFECTS:
            rng = random.Random(f"{args.rng}-{n}-{effect}")
            tally = {"search_detect": 0, "search_false": 0, "detect": 0, "false_keep": 0}
            for _ in range(args.studies):
                for key, hit in simulate_study(brief, effect, args.sigma, rng).items():
                    tally[key] += hit
            rate = {k: v / args.studies for k, v in tally.items()}
            detect = ("-" if effect == 0 else f"{rate['search_detect']:.3f}",
                      "-" if effect == 0 else f"{rate['detect']:.3f}")
            print(f"| {n}{' (default)' if n == len(default.seeds) else ''} | {effect:g}σ | {detect[0]} | {detect[1]} "
                  f"| {rate['search_false']:.3f} | {rate['false_keep']:.3f} |", flush=True)
            if n == len(default.seeds) and effect == 2.0:
                headline["detect"] = rate["detect"]
            if n == len(default.seeds) and effect == 0.0:
                headline["false_keep"] = rate["false_keep"]
    print(f"({time.time() - started:.0f} s)")
    ab = ab_table(max(args.ab_trials, 40), default.run.swap_window, default.objective.direction, args.rng)
    if args.live_trials:
        live = rigor_live.trials(args.live_trials, default.run.swap_window, default.objective.direction)
        nulls = [v for planted, v in live if not planted]
        print(f"live A/B: {len(nulls)} real null swaps into a tiny run, {sum(v.result == 'better' for v in nulls)} "
              f"called better; planted +{rigor_live.PLANTED}: {[v.result for planted, v in live if planted]}")
    print(f"rigor: detection_2sigma={headline['detect']:.3f} false_keep={headline['false_keep']:.3f} "
          f"ab_detection={ab['detect']:.3f} ab_false_keep={ab['false_keep']:.3f} seeds={len(default.seeds)}")


if __name__ == "__main__":
    main()
