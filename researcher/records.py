"""What a study remembers: proposals, decisions, launches and experiment results.

These are plain pydantic values. The study graph keeps them (as dicts) in its checkpointed state,
the review surface mirrors proposals and decisions onto MLflow runs, and the report renders
them. Nothing here plans, launches or reads MLflow.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Ruling = Literal["approved", "vetoed"]  # a person's review decision (a statistical one is a Verdict)
# Validation steps of a code proposal, in the order they run (see researcher/code/validation.py): the static
# ones read the code, the executing ones run it (after approval when a person must approve it).
STATIC_STEPS = ("apply", "compile", "contract")
EXECUTING_STEPS = ("import", "tests", "smoke")
VALIDATION_STEPS = STATIC_STEPS + EXECUTING_STEPS
DecisionSource = Literal["cli", "mlflow", "policy"]
# `stalled`: stopped by the study because it logged no new metric for `monitor.stall_s` (a hang);
# `stopped`: stopped for any other reason (collapse, timeout, budget, a person).
LaunchStatus = Literal["queued", "running", "finished", "failed", "stopped", "stalled", "skipped"]
TERMINAL: frozenset[str] = frozenset({"finished", "failed", "stopped", "stalled", "skipped"})


# A statistical verdict, as the decision rule (researcher.evidence.decision) gives it and the study keeps it.
Result = Literal["better", "worse", "inconclusive", "incomplete"]
# The core's per-step means of what an episode cost (core.run.rollout_metrics): recorded model calls and sampled
# completion tokens. A harness that buys its score with more compute says so beside every verdict.
COST_METRICS = {"calls": "episode/calls", "tokens": "episode/tokens"}


class Cost(BaseModel):
    """An arm's calls and completion tokens per episode, averaged over its steps and seeds (None: not logged)."""

    calls: float | None = None
    tokens: float | None = None

    def fmt(self) -> str:
        if self.calls is None and self.tokens is None:
            return f"not logged ({', '.join(COST_METRICS.values())})"
        calls = f"{self.calls:.3g} calls" if self.calls is not None else "calls not logged"
        tokens = f"{self.tokens:.4g} tokens" if self.tokens is not None else "tokens not logged"
        return f"{calls}, {tokens}"


class Verdict(BaseModel):
    """A candidate against the baseline: what the study may claim, and the numbers behind it."""

    result: Result
    test: str  # the test's name: "paired t-test", "Welch's t-test", or "none" when none could run
    effect: float | None = None  # mean(candidate) - mean(baseline), in the objective's units
    ci: list[float] | None = None  # 95% confidence interval of the effect, [low, high]
    p: float | None = None  # two-sided p-value of the test, before any correction
    p_adjusted: float | None = None  # Holm–Bonferroni adjusted p across the round's candidates
    n: int = 0  # finished seeds of the candidate
    n_baseline: int = 0  # finished seeds of the baseline
    baseline: str | None = None  # the baseline proposal's id
    reason: str = ""  # why the result is what it is, in words for the report
    # A look of a group-sequential test (researcher.evidence.sequential): which look this is, how many
    # the design planned, and the nominal two-sided level it was judged at. None: a fixed-size test.
    look: int | None = None
    looks: int | None = None
    level: float | None = None
    # Per episode, what each arm's score cost: the candidate's and its reference's (None: not known when judged).
    cost: Cost | None = None
    cost_baseline: Cost | None = None

    def json_view(self) -> dict[str, object]:
        """The machine-readable form of `show --json`: result, test, effect, ci, p."""
        return {"result": self.result, "test": self.test, "effect": self.effect, "ci": self.ci,
                "p": self.p if self.p_adjusted is None else self.p_adjusted}

    def fmt_cost(self) -> str:
        """Each arm's calls and tokens per episode, or "" when neither arm's is known."""
        if self.cost is None and self.cost_baseline is None:
            return ""
        mine, theirs = (c.fmt() if c else "not known" for c in (self.cost, self.cost_baseline))
        return f"per episode: {mine} vs {theirs} ({self.baseline or 'the reference'})"

    def fmt(self) -> str:
        """One line for reports and history: result, effect with CI, p and the test."""
        if self.effect is None or self.ci is None:
            cost = f"; {self.fmt_cost()}" if self.fmt_cost() else ""
            return (f"{self.result} ({self.reason})" if self.reason else self.result) + cost
        p = self.p_adjusted if self.p_adjusted is not None else self.p
        p_text = f"p={p:.3g}" + (" Holm-adjusted" if self.p_adjusted is not None else "") if p is not None else ""
        look = (f", look {self.look} of {self.looks} at nominal p < {self.level:.3g}"
                if self.look is not None and self.level is not None else "")
        cost = f"; {self.fmt_cost()}" if self.fmt_cost() else ""
        return (f"{self.result}: effect {self.effect:+.4g} [95% CI {self.ci[0]:+.4g}, {self.ci[1]:+.4g}], "
                f"{p_text}, {self.test}, n={self.n} vs {self.n_baseline}{look}"
                + (f" ({self.reason})" if self.reason else "") + cost)


class Confirmation(BaseModel):
    """The outcome of re-running the recommendation and the baseline on held-out seeds."""

    proposal_id: str  # the recommended experiment from the search
    seeds: list[int]  # the held-out seeds both were re-run on
    verdict: Verdict  # the confirmation's own verdict (no correction: one comparison)
    replicated: bool = Field(description="the recommendation stands only when this is true")
    stages: list[Verdict] = Field(default_factory=list)  # each look's verdict when seeds were added in stages

    def fmt(self) -> str:
        head = "replicated" if self.replicated else "did not replicate"
        return f"{head} on held-out seeds {self.seeds}: {self.verdict.fmt()}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Edit(BaseModel):
    """One search/replace block against a workspace file (the aider/MLGym style)."""

    model_config = ConfigDict(extra="forbid")

    file: str  # path relative to the workspace root, e.g. sandboxes/letters/agent.py
    search: str  # exact text that must occur once in the file; "" creates a new file
    replace: str  # what replaces it


class Prediction(BaseModel):
    """A falsifiable claim a proposal makes before it runs: the verdict later says if it held."""

    model_config = ConfigDict(extra="forbid")

    metric: str  # the MLflow metric it is about, usually the objective
    direction: Literal["up", "down", "same"]  # against the baseline
    effect: float  # expected difference of means against the baseline, in the metric's units


HOT_SWAP_NEEDS_CODE = ("mode hot_swap swaps a code change into the live run, and this proposal has no code "
                       "(no edits, no patch): a config-only change needs runs of its own (mode runs)")


class ProposalDraft(BaseModel):
    """A planner's structured output for one experiment, before the study gives it an id."""

    model_config = ConfigDict(extra="forbid")

    hypothesis: str = Field(min_length=3)  # what we believe and want to test
    rationale: str = Field(min_length=3)  # why, from the brief and earlier results
    overrides: dict[str, Any] = Field(default_factory=dict)  # dotted run-config key -> value
    expected_effect: str = Field(min_length=3)  # what the objective should do if the hypothesis holds
    priority: int = Field(1, ge=1, le=10)  # 1 runs first
    needs_code_change: bool = False
    code_change: str | None = None  # "AREA: what to change" when needs_code_change
    edits: list[Edit] = Field(default_factory=list)  # the code change itself, applied in the workspace
    parent: str | None = None  # the code proposal whose version these edits build on; None: the base
    prediction: Prediction | None = None  # what the planner expects against the baseline
    ablation: bool = False  # removes or reverts one part of a parent to test whether it mattered
    # runs: the change gets core runs of its own; hot_swap: a code change swapped into the study's live
    # run (`run.live: true`), judged by the reward of the new version against the old one there.
    mode: Literal["runs", "hot_swap"] = "runs"

    @field_validator("code_change")
    @classmethod
    def _blank_is_none(cls, value: str | None) -> str | None:
        return value if value and value.strip() else None

    @model_validator(mode="after")
    def _hot_swap_is_code(self):
        """A config-only hot swap would never run (nothing to swap) and stay approved forever: refused."""
        if self.mode == "hot_swap" and not self.edits and not getattr(self, "patch", None):
            raise ValueError(HOT_SWAP_NEEDS_CODE)
        return self


class Proposal(ProposalDraft):
    id: str  # r<round>-<index>: stable across resumes
    round: int
    planner: str  # "heuristic" or "llm:<model>"
    arm: str | None = None  # heuristic: canonical id of the configuration
    rung: int | None = None  # heuristic: successive-halving rung
    patch: str | None = None  # a person's unified diff (`researcher study propose --patch`)
    proposed_by: str = ""  # the person behind a proposal from `propose`; "" for the planner's
    seeds: list[int] | None = None  # seeds to run instead of the brief's (confirmation: held-out seeds)
    confirms: str | None = None  # confirmation round: the recommended proposal this re-runs (or its baseline)
    # The workspace commit this proposal's runs check out instead of the base: the confirmation of a code
    # proposal runs the pick's own commit (with its overrides). None: its own code version, else the base.
    commit: str | None = None
    # An arm others are judged against and never judged itself: a baseline the study added (base code with a
    # code proposal's overrides), a confirmation's baseline, or a parent's reference (`parent`'s code).
    reference: bool = False
    # A replication stage (researcher.evidence.stages): more seeds for the arm `extends`, pooled with it.
    extends: str | None = None
    stage: int = 1  # 1 for an arm's first seeds; k for its k-th stage
    # The group-sequential design of this arm's comparison: seeds per arm planned at each look (the last is
    # the most it may reach); None: a fixed-size test (researcher.evidence.sequential).
    looks: list[int] | None = None

    @property
    def kind(self) -> Literal["config", "code"]:
        return "code" if self.edits or self.patch else "config"

    def diff_text(self, base: dict[str, str]) -> str:
        """`key: old -> new` lines against the flattened base config."""
        rows = [f"{k}: {base.get(k, '(unset)')} -> {v}" for k, v in sorted(self.overrides.items())
                if base.get(k) != str(v)]
        if self.code_change:
            rows.append(f"code: {self.code_change}")
        if self.kind == "code":
            rows.append(f"code: {len(self.edits)} edit(s)" if self.edits else "code: a patch")
        return "\n".join(rows) or "(no change: baseline)"

    def steps(self, default: int) -> int:
        """The trainer steps it runs: its own `trainer.steps` override, else `default` (the base config's)."""
        return int(self.overrides.get("trainer.steps", default))


class Decision(BaseModel):
    """Who decided what about a proposal, when and why."""

    proposal_id: str
    verdict: Ruling
    by: str  # the OS user or --by; "policy" for auto-approval; the tag's review.by for MLflow edits
    at: str = Field(default_factory=now_iso)
    reason: str = ""
    source: DecisionSource = "cli"
    at_poll_time: bool = False  # the reviewer set no `review.at` in MLflow: `at` is when the study saw it
    # A decision read from MLflow (source `mlflow`): whether the server authenticated whoever wrote it (MLflow's
    # basic-auth app: one of the accounts with edit rights on the study's experiment). MLflow records no author
    # of a tag edit, so `by` stays the name the reviewer typed; without authentication anyone who reached the
    # server could have written it (docs/security.md).
    authenticated: bool = False


class IgnoredChange(BaseModel):
    """A decided proposal's review tags changed after the decision (say approved turned to vetoed in
    the MLflow UI). A decision is final: the change is recorded in the history and changes nothing."""

    proposal_id: str
    decided: Ruling  # the decision that stands
    changed_to: str  # the review.status the tag was set to
    by: str  # the change's own review.by; "mlflow-ui" when the reviewer set none
    at: str  # the change's own review.at; else when the study saw it
    at_poll_time: bool = False  # the change carried no review.at of its own: `at` is when it was seen


class Launch(BaseModel):
    """One core run: an approved experiment under one seed."""

    key: str  # <proposal id>-s<seed>: the identity that makes launches idempotent
    proposal_id: str
    seed: int
    steps: int  # trainer steps the run was asked for
    status: LaunchStatus = "queued"
    config_path: str = ""
    log_path: str = ""
    pid: int | None = None
    run_id: str | None = None  # MLflow run id written by `swarm run --run-id-file`
    started_at: float | None = None
    ended_at: float | None = None
    reason: str = ""  # why it failed, stopped or was skipped
    log_tail: str = ""  # last lines of the log of a failed run
    steps_done: int = 0
    commit: str = ""  # workspace commit the run's sandbox code is checked out at ("" for the project's code)
    attempt: int = 0  # 1 for the one re-run of a seed whose first run failed or stopped early
    resumes: str = ""  # the dead launch whose checkpoint this re-run continues (`swarm run --resume`)
    progress_at: float | None = None  # when the run last logged a new trainer step (stall detection)


class Summary(BaseModel):
    """An objective over seeds: mean and a 95% confidence interval."""

    n: int
    mean: float
    std: float
    ci_low: float
    ci_high: float

    def fmt(self) -> str:
        if self.n == 0 or math.isnan(self.mean):
            return "n/a"
        if self.n == 1:
            return f"{self.mean:.4g} (1 seed)"
        return f"{self.mean:.4g} ± {(self.ci_high - self.ci_low) / 2:.2g} ({self.n} seeds)"


class ExperimentResult(BaseModel):
    proposal_id: str
    status: Literal["ok", "failed", "skipped"]
    values: list[float] = Field(default_factory=list)  # per-seed objective scores of usable runs
    summary: Summary | None = None
    note: str = ""
    seed_scores: dict[int, float] = Field(default_factory=dict)  # seed -> score of its finished run
    failed_seeds: dict[int, str] = Field(default_factory=dict)  # seed -> why it has no score (after re-run)
    verdict: Verdict | None = None  # against the baseline; None for the baseline itself
    confirmation: Confirmation | None = None  # set on the recommendation once held-out seeds are judged
    # A chained code proposal against its parent's code run with the same config, steps and seeds.
    parent_verdict: Verdict | None = None
    # seed -> the trainer step a plateau stop ended it at: it is scored there, and so is every arm it is
    # compared with on that seed (analysis.judge), so no arm loses only its seeds that converged early.
    stopped_at: dict[int, int] = Field(default_factory=dict)
    stages: list[Verdict] = Field(default_factory=list)  # each look's verdict when seeds were added in stages
    cost: Cost | None = None  # calls and tokens per episode over its scored seeds (None: none logged)
    # The mean curve over seeds in numbers a planner can read: start, end, slope (per step),
    # best_step, and the last train/kl, train/entropy and train/clip_frac (analysis.curve_summary).
    curve: dict[str, float] = Field(default_factory=dict)


class SwapSide(BaseModel):
    """One side of a hot swap's comparison: a code version's per-step rewards in the live run."""

    version: str
    steps: dict[int, float] = Field(default_factory=dict)  # trainer step -> mean reward of that version's episodes

    @property
    def mean(self) -> float | None:
        return sum(self.steps.values()) / len(self.steps) if self.steps else None


class SwapResult(BaseModel):
    """A hot swap of a proposal's code into the live run as an A/B, as done and as judged (researcher/runs/live_swaps.py)."""

    proposal_id: str
    n: int  # the live server's swap number; tag `swarmrl.swap.<n>` on the live run
    step: int | None  # the trainer step at which the new client started serving beside the old ones
    sandbox: str
    from_version: str
    to_version: str
    before: SwapSide | None = None  # the old version's last `swap_window` steps up to the swap: a picture only
    after: SwapSide | None = None  # the new version over the A/B's `swap_window` steps after the swap
    old: SwapSide | None = None  # the old version over the same steps as `after`, beside it
    # `after` against `old`, paired by step (evidence.ab.judge_ab, Holm across the round); never before/after.
    verdict: Verdict | None = None
    # A `better` verdict's confirmation: the same test on the next `swap_window` steps, which the verdict never
    # saw (evidence.ab.confirm_ab); the new version is kept only when it is `better` too. None: nothing to confirm.
    confirmation: Verdict | None = None
    kept: str | None = None  # the version that serves on once the loser drained (None: not yet drained)


class StepResult(BaseModel):
    """One validation step of a code proposal."""

    step: str  # one of VALIDATION_STEPS
    passed: bool
    log: str = ""  # what the step printed, cut to its tail
    seconds: float = 0.0


class CodeVersion(BaseModel):
    """A code proposal's validation and, when it passed, its commit in the study workspace."""

    proposal_id: str
    parent_commit: str  # the commit the edit was applied on
    passed: bool
    commit: str = ""  # set only when every step passed
    failed_step: str | None = None
    steps: list[StepResult] = Field(default_factory=list)
    diff: str = ""  # `git diff` of the change against its parent (empty when it did not apply)
    pending: list[str] = Field(default_factory=list)  # executing steps still to run, after approval

    def log(self) -> str:
        done = "\n".join(f"== {s.step}: {'passed' if s.passed else 'FAILED'} ({s.seconds:.1f} s)\n{s.log}".rstrip()
                         for s in self.steps)
        return done + (f"\n== to come after approval: {', '.join(self.pending)}" if self.pending else "")

    def checks(self) -> str:
        """Which checks ran and which are still to come, in one line (review surfaces)."""
        ran = ", ".join(f"{s.step} {'ok' if s.passed else 'FAILED'}" for s in self.steps) or "none"
        return f"checks run: {ran}" + (f"; to come after approval: {', '.join(self.pending)}" if self.pending else "")

