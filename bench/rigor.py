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

The in-run A/B of a hot swap (`bench/rigor_ab.py`) is judged by the study's own `researcher.evidence.ab`
(the HAC test over a window, a win kept only when the next window confirms it) on simulated per-step
scores of a learning run, under independent and under version-specific AR(0.5) noise with unequal
counts. `bench/rigor_live.py` then makes real null A/B swaps into a live tiny run
and judges them with the same code. The last line holds the figures for the brief's defaults:

    rigor: detection_2sigma=<x> false_keep=<y> ab_detection=<a> ab_false_keep=<b> ab_false_keep_ar05=<c>
        adaptive_detection_3seeds=<d> live_trials=<n> seeds=<s>

with false_keep the rate at which a study of null changes ends recommending one, ab_detection the
rate a 2-sigma swap is kept (better, and confirmed), ab_false_keep the rate a null swap is,
ab_false_keep_ar05 the same under AR(0.5) per-version noise and unequal counts, and live_trials the
real null swaps made (`--live-trials 0` skips them: no core run, no MLflow).

    .venv/bin/python bench/rigor.py [--studies 300] [--seeds 3 5] [--sigma 1.0] [--ab-trials 400] [--live-trials 5]
"""

from __future__ import annotations

import argparse
import random
import time

import rigor_ab  # bench/rigor_ab.py and bench/rigor_live.py, beside this script
import rigor_live

from researcher.brief.loader import parse_brief
from researcher.brief.schema import Brief
from researcher.evidence import analysis, baselines, confirmation, decision, stages
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
{replicate}
---
"""
# The seed count the adaptive headline starts from (issue 31: a study started at 3 seeds adds the rest).
ADAPTIVE_START = 3


def make_brief(seeds: int | None, replicate: bool = True) -> Brief:
    """The rigor brief; `replicate` False turns the staged seeds off (fixed-size tests, the old rule)."""
    text = BRIEF.format(base=BASE_LR, planted=PLANTED_LR, null0=NULL_LRS[0], null1=NULL_LRS[1],
                        seeds="" if seeds is None else f"seeds: {seeds}",
                        replicate="" if replicate else "replicate: {enabled: false}")
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

    while True:  # the search is over: replication stages and the confirmation, as the plan node runs them
        fresh = stages.next_stage(proposals, results, brief, base_values, BASE_STEPS, number, 10**6, 10**9)
        if fresh is None and (pick := confirmation.owed(proposals, results, BASE_STEPS, brief)) is not None:
            result = next(r for r in results if r.proposal_id == pick.id)
            looks = stages.confirmation_design(brief, 10**6, 10**9, BASE_STEPS)
            fresh = confirmation.proposals_for(pick, result, proposals, brief, base_values, BASE_STEPS, number,
                                               looks=looks)
        if fresh is None:
            break
        proposals += fresh
        new = [runs(p, p.seeds or []) for p in fresh]
        results += analysis.judge(new, proposals, base_values, BASE_STEPS, objective, known=results)
        results = stages.attach(confirmation.attach(results, proposals, base_values), proposals)
        number += 1
    roots = {p.id: p for p in proposals if p.confirms is None and p.extends is None}  # a stage's look is its root's
    longest: dict[float, ExperimentResult] = {}
    for r in results:
        if r.proposal_id in roots:  # in round order: the last is the longest
            longest[roots[r.proposal_id].overrides.get("trainer.lr", BASE_LR)] = r
    searched_better = {lr for lr, r in longest.items() if r.verdict is not None and r.verdict.result == "better"}
    found = confirmation.search_recommendation(proposals, results, BASE_STEPS, brief)
    kept = None
    if found is not None and found[1].confirmation is not None and found[1].confirmation.replicated:
        kept = found[0].overrides.get("trainer.lr", BASE_LR)
    return {"search_detect": PLANTED_LR in searched_better,
            "search_false": any(lr in searched_better for lr in NULL_LRS) or (effect == 0 and PLANTED_LR in searched_better),
            "detect": kept == PLANTED_LR,
            "false_keep": kept in NULL_LRS or (effect == 0 and kept == PLANTED_LR),
            "runs": sum(len(p.seeds or brief.seeds) for p in proposals)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--studies", type=int, default=300, help="simulated studies per (effect, seeds) cell")
    ap.add_argument("--seeds", type=int, nargs="*", default=[3, 5], help="seed counts besides the brief's default")
    ap.add_argument("--sigma", type=float, default=1.0, help="seed noise (std of one run's score)")
    ap.add_argument("--rng", type=int, default=0, help="seeds the simulated noise")
    ap.add_argument("--ab-trials", type=int, default=400, help="simulated swaps per A/B cell (at least 40)")
    ap.add_argument("--live-trials", type=int, default=rigor_live.TRIALS,
                    help="real null A/B swaps into a live tiny run; 0: none")
    ap.add_argument("--fixed", action="store_true", help="replication off (fixed-size tests), for comparison")
    args = ap.parse_args()
    default = make_brief(None, replicate=not args.fixed)
    counts = [len(default.seeds)] + [n for n in [*args.seeds, ADAPTIVE_START] if n != len(default.seeds)]
    counts = list(dict.fromkeys(counts))
    design = ("replication off" if args.fixed else
              f"replication on: up to {default.replicate.max_looks} looks, {default.replicate.boundary} spending")
    print(f"rigor: {args.studies} simulated studies per cell; sigma {args.sigma}; independent noise per run; "
          f"alpha {decision.ALPHA}; brief default seeds {len(default.seeds)}; {design}")
    print("| seeds | effect | detection (search) | detection (confirmed) | false keep (search) | false keep (kept) "
          "| runs per study |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    started = time.time()
    headline: dict[str, float] = {}
    for n in counts:
        brief = default if n == len(default.seeds) else make_brief(n, replicate=not args.fixed)
        for effect in EFFECTS:
            rng = random.Random(f"{args.rng}-{n}-{effect}")
            tally = {"search_detect": 0, "search_false": 0, "detect": 0, "false_keep": 0, "runs": 0}
            for _ in range(args.studies):
                for key, hit in simulate_study(brief, effect, args.sigma, rng).items():
                    tally[key] += hit
            rate = {k: v / args.studies for k, v in tally.items()}
            detect = ("-" if effect == 0 else f"{rate['search_detect']:.3f}",
                      "-" if effect == 0 else f"{rate['detect']:.3f}")
            print(f"| {n}{' (default)' if n == len(default.seeds) else ''} | {effect:g}σ | {detect[0]} | {detect[1]} "
                  f"| {rate['search_false']:.3f} | {rate['false_keep']:.3f} | {rate['runs']:.1f} |", flush=True)
            if n == len(default.seeds) and effect == 2.0:
                headline["detect"] = rate["detect"]
            if n == len(default.seeds) and effect == 0.0:
                headline["false_keep"] = rate["false_keep"]
            if n == ADAPTIVE_START and effect == 2.0:
                headline["adaptive"] = rate["detect"]
    print(f"({time.time() - started:.0f} s)")
    ab = rigor_ab.ab_table(max(args.ab_trials, 40), default.run.swap_window, default.objective.direction, args.rng)
    live = rigor_live.trials(args.live_trials, default.run.swap_window, default.objective.direction) if (
        args.live_trials) else []
    if live:
        print(rigor_live.summary(live))
    print(f"rigor: detection_2sigma={headline['detect']:.3f} false_keep={headline['false_keep']:.3f} "
          f"ab_detection={ab['detect']:.3f} ab_false_keep={ab['false_keep']:.3f} "
          f"ab_false_keep_ar05={ab['false_keep_ar05']:.3f} "
          f"adaptive_detection_3seeds={headline['adaptive']:.3f} "
          f"live_trials={len(live)} seeds={len(default.seeds)}")


if __name__ == "__main__":
    main()
