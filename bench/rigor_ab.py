"""The in-run A/B of a hot swap on simulated learning runs, judged by the study's own code.

`bench/rigor.py` calls `ab_table`. Each trial simulates per-step scores of a learning run: a shared
drifting curve and the weights' autocorrelated wander, common to both versions at a step (the core
pairs them on the same tasks and weights, so these cancel in the per-step difference), plus each
version's own noise. Two noise models of the version's own part:

- `independent`: episode noise, independent from step to step, equal counts;
- `AR(0.5), unequal counts`: the version's own noise is AR(0.5) from step to step (whatever a version
  carries over: its clients' state, its share of the work) and the episodes per step split unequally
  (43/57 on average, binomial per step: a step where one version finished nothing is not logged, as in
  a live run), so each step's noise scales with 1/sqrt(its count). Here the paired t-test calls a null
  swap better about 12% of the time over 10 steps; the A/B must not.

Each trial runs the study's rule: `researcher.evidence.ab.judge_ab` over the first `swap_window`
paired steps, then, for a `better`, `confirm_ab` over the next `swap_window` steps; the new version is
kept only when both say better. It prints, per model, window and effect: the first window's better
rate (the HAC test alone), the kept rate, the paired t-test on the same first window (the old rule),
and the before/after verdict the A/B replaced. It launches nothing; the real swaps are bench/rigor_live.py.
"""

from __future__ import annotations

import random

from researcher.evidence import ab, decision

AB_EFFECTS = (0.0, 1.0, 2.0, 3.0)  # in units of sigma, the std of one version's per-step score
AB_WINDOWS = (5, 10, 20)  # besides the brief's default `run.swap_window`
# One version's per-step score around the curve: the weights' AR(1) wander (shared by both versions at
# a step: same weights) and the version's own noise, splitting sigma^2 0.36 : 0.64.
AB_PHI, AB_WANDER, AB_OWN = 0.8, 0.6, 0.8
AB_PRE = 20  # steps the old version trains alone before the swap (the before/after verdict's "before")
AB_RISE = (0.05, 0.15)  # the learning curve's slope per step, in sigma, drawn per trial: a drifting run
OWN_PHI = 0.5  # the autocorrelation of a version's own noise in the second model (issue 31's AR(0.5))
EPISODES_PER_STEP = 8  # episodes both versions finish per step, split between them
NEW_SHARE = 0.43  # the new version's mean share: the 57/43 split a real swap showed
MODELS = ("independent", "AR(0.5), unequal counts")


def _own_noise(model: str, rng: random.Random):
    """A generator of one version's own per-step noise under `model` (None: the version logged nothing)."""
    innovation = AB_OWN * (1 - OWN_PHI**2) ** 0.5
    drift = rng.gauss(0.0, AB_OWN)
    while True:
        if model == MODELS[0]:
            yield rng.gauss(0.0, AB_OWN)
            continue
        drift = OWN_PHI * drift + rng.gauss(0.0, innovation)
        yield drift


def ab_trial(model: str, effect: float, window: int, direction: decision.Direction,
             rng: random.Random) -> dict[str, bool]:
    """One simulated swap: its first-window verdict, whether it was kept, the t-test's and before/after's."""
    sign = 1.0 if direction == "maximize" else -1.0
    slope = rng.uniform(*AB_RISE)
    innovation = AB_WANDER * (1 - AB_PHI**2) ** 0.5  # stationary std AB_WANDER
    wander = rng.gauss(0.0, AB_WANDER)
    own_old, own_new = _own_noise(model, rng), _own_noise(model, rng)
    old: dict[int, float] = {}
    new: dict[int, float] = {}
    before: dict[int, float] = {}
    t = 0
    while len(new) < 2 * window:  # the A/B's window, then the confirmation's: steps where both logged
        wander = AB_PHI * wander + rng.gauss(0.0, innovation)
        shared = sign * slope * t + wander  # the run learns in the objective's direction
        a, b = next(own_old), next(own_new)
        if t < AB_PRE:
            before[t] = shared + a
        else:
            k_new = sum(rng.random() < NEW_SHARE for _ in range(EPISODES_PER_STEP)) if model != MODELS[0] else 4
            k_old = EPISODES_PER_STEP - k_new
            if k_new and k_old:  # each step's mean over its count of episodes (4 each: the noise as given)
                old[t] = shared + a * (4 / k_old) ** 0.5
                new[t] = shared + sign * effect + b * (4 / k_new) ** 0.5
        t += 1
    steps = sorted(new)
    first, second = steps[:window], steps[window:]
    verdict = ab.judge_ab({s: new[s] for s in first}, {s: old[s] for s in first}, direction, baseline_id="old")
    kept = verdict.result == "better" and ab.confirm_ab(
        verdict, {s: new[s] for s in second}, {s: old[s] for s in second}, direction).result == "better"
    t_test = decision.compare({s: new[s] for s in first}, {s: old[s] for s in first}, direction)
    last_before = {s: v for s, v in before.items() if s >= AB_PRE - window}
    before_after = decision.compare({s: new[s] for s in first}, last_before, direction)
    return {"better": verdict.result == "better", "kept": kept, "t_test": t_test.result == "better",
            "before_after": before_after.result == "better"}


def ab_table(trials: int, default_window: int, direction: decision.Direction, seed: int) -> dict[str, float]:
    """Print the A/B's rates per model, window and effect; -> the headline rates at the default window
    (`detect`, `false_keep`: kept 2σ and null swaps, independent noise; `false_keep_ar05`: kept null swaps
    under AR(0.5) noise and unequal counts)."""
    windows = [default_window] + [w for w in AB_WINDOWS if w != default_window]
    print(f"in-run A/B: {trials} simulated swaps per cell on learning runs (slope {AB_RISE[0]}-{AB_RISE[1]} sigma "
          f"per step, shared AR({AB_PHI}) wander {AB_WANDER} sigma, own noise {AB_OWN} sigma); first window: "
          f"ab.judge_ab ({ab.HAC}); kept: better there and in the next window (ab.confirm_ab); brief default "
          f"swap_window {default_window}")
    print("| noise | window | effect | A/B better (1st window) | kept (confirmed) | paired t-test better "
          "| before/after better |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    headline: dict[str, float] = {}
    for model in MODELS:
        for window in windows:
            for effect in AB_EFFECTS:
                rng = random.Random(f"ab-{seed}-{model}-{window}-{effect}")
                results = [ab_trial(model, effect, window, direction, rng) for _ in range(trials)]
                rate = {k: sum(r[k] for r in results) / trials for k in results[0]}
                print(f"| {model} | {window}{' (default)' if window == default_window else ''} | {effect:g}σ "
                      f"| {rate['better']:.3f} | {rate['kept']:.3f} | {rate['t_test']:.3f} "
                      f"| {rate['before_after']:.3f} |", flush=True)
                if window == default_window and model == MODELS[0] and effect == 2.0:
                    headline["detect"] = rate["kept"]
                if window == default_window and model == MODELS[0] and effect == 0.0:
                    headline["false_keep"] = rate["kept"]
                if window == default_window and model == MODELS[1] and effect == 0.0:
                    headline["false_keep_ar05"] = rate["kept"]
    return headline
