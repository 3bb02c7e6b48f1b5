"""The llm planner: proposals as structured output from any OpenAI-compatible endpoint.

The model sees the brief, the search space, the budget left and the history a researcher would
read: each proposal's decision and veto reason, per-seed scores, its verdict against the baseline
(test, effect, CI, p), a curve summary (start, end, slope, best step, kl, entropy, clip fraction)
and why any seed failed with the tail of its log; the best few first, then the newest, cut to the
brief's history budget. Each proposal carries a falsifiable `prediction`, its `parent` and
whether it is an `ablation`; a configuration already run is refused as a repeat. It must answer with one JSON object that validates against
`LlmPlan`; the proposals must also stay inside the search space and must not repeat a vetoed
configuration. Requests carry `LlmPlan`'s JSON schema as `response_format` where the endpoint takes
it; where it does not (a 400, or a server that ignores the field) the reply is extracted from prose
and fences and checked all the same. Invalid output is re-asked a bounded number of times with the
error fed back, and then fails with a clear `PlannerError`. Every token the endpoint reports,
failed attempts and error replies that carry `usage` included, is counted against the brief's
budget (a failed plan's tokens travel on the `PlannerError`). The endpoint's own retries are off, so the brief's bound is the only one; requests
go through `researcher.planner.endpoint`, which names the model and fits each request to its context.

It plans; it does not review, launch, or apply code changes.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

import openai
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from researcher.brief.schema import ChoiceParam, RangeParam
from researcher.evidence.analysis import is_reference
from researcher.planner.code_context import describe_code, edit_problems
from researcher.planner.endpoint import Endpoint, error_usage
from researcher.planner.types import PlanContext, Planned, PlannerError, PlanResult
from researcher.code.lineage import parent_problem
from researcher.records import Proposal, ProposalDraft

log = logging.getLogger(__name__)

# Bad output echoed back on a retry is cut to this many characters: enough to see the mistake,
# not enough to blow the context of a small model.
_ECHO_CHARS = 500
# Without a `usage` field from the server, tokens are estimated at this many characters each.
_CHARS_PER_TOKEN = 4
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
# The history shows the best few experiments first (what to build on), then the newest.
_BEST_FIRST = 3
# A failed run's log is shown as its last few lines, cut: enough for the error, not the whole trace.
_LOG_TAIL_LINES = 3
_LOG_TAIL_CHARS = 300


class LlmPlan(BaseModel):
    """The JSON object the model must return."""

    model_config = ConfigDict(extra="forbid")

    proposals: list[ProposalDraft] = Field(default_factory=list)
    stop: bool = False  # the model believes nothing more is worth trying
    stop_reason: str = ""


# Structured output for endpoints that take it: the same shape the example below shows.
PLAN_SCHEMA = LlmPlan.model_json_schema()
# The reply format as a compact example rather than a JSON schema dump: small models follow an
# example better, and the prompt must fit small contexts (the project's own `tiny` model: 2048).
FORMAT = ('{"proposals": [{"hypothesis": "...", "rationale": "...", "overrides": {"search.key": value}, '
          '"expected_effect": "...", "prediction": {"metric": "...", "direction": "up", "effect": 0.1}, '
          '"parent": null, "ablation": false, "priority": 1, "needs_code_change": false, "code_change": null}], '
          '"stop": false, "stop_reason": ""}')

SYSTEM = """You plan experiments for a reinforcement-learning research study.
Reply with ONE JSON object and nothing else, shaped like:
{format}
Rules:
- `overrides` keys must be search-space keys; values must lie inside their range or choices.
- A code change: needs_code_change=true, code_change="AREA: what to change" (AREA: a code area of the
  search space). Code changes wait for a human.
- priority: 1 (run first) to 10. Never repeat a configuration already run or vetoed; learn from the reasons.
- prediction: the metric, its direction against the baseline (up, down, same), the expected difference of
  means. parent: the id of the proposal this builds on, or null. ablation: true when it removes one part of
  its parent to test whether that part mattered.
- The study runs the baseline itself (base config at the base commit, same seeds and steps): never propose
  it. A code change is judged against the base commit with its own overrides, a chain also against its
  parent. Verdicts are tests on the same seeds; only `better` counts as progress.
- At most {n} proposals. Set "stop": true when nothing more is worth the budget."""


def _describe_space(ctx: PlanContext) -> str:
    rows = []
    for key, p in ctx.brief.search_space.items():
        if isinstance(p, RangeParam):
            rows.append(f"- {key}: range [{p.low}, {p.high}]{' log' if p.log else ''}"
                        f"{' integer' if p.integer else ''} (base {ctx.base_values.get(key)})")
        elif isinstance(p, ChoiceParam):
            rows.append(f"- {key}: one of {p.values} (base {ctx.base_values.get(key)})")
        else:
            rows.append(f"- {key}: code area, files {p.paths}. {p.description}")
    return "\n".join(rows)


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()][-_LOG_TAIL_LINES:]
    return " | ".join(lines)[-_LOG_TAIL_CHARS:]


def _describe_experiment(ctx: PlanContext, p: Proposal) -> str:
    """Everything a researcher would look at for one experiment, in a few lines."""
    d, r = ctx.verdict(p.id), ctx.result(p.id)
    decision = f"{d.verdict} by {d.by}" + (f" ({d.reason})" if d.reason else "") if d else "pending"
    tags = [f"parent {p.parent}"] if p.parent else []
    tags += ["ablation"] if p.ablation else []
    tags += [f"confirmation of {p.confirms} on held-out seeds {p.seeds}"] if p.confirms else []
    rows = [f"- {p.id} {json.dumps(p.overrides)} code={p.code_change or '-'}"
            + (f" [{'; '.join(tags)}]" if tags else "") + f": {decision}. Hypothesis: {p.hypothesis}"]
    if p.prediction is not None:
        rows.append(f"  predicted: {p.prediction.metric} {p.prediction.direction} by {p.prediction.effect:+.4g}")
    if r is not None:
        seeds = ", ".join(f"{s}: {v:.4g}" for s, v in sorted(r.seed_scores.items())) or "none"
        rows.append(f"  {ctx.brief.objective.metric} = {r.summary.fmt() if r.summary else r.status}; per seed {{{seeds}}}")
        rows.append("  verdict vs baseline: " + (r.verdict.fmt() if r.verdict else "(this is the baseline)"))
        if r.confirmation is not None:
            rows.append(f"  confirmation: {r.confirmation.fmt()}")
        if r.curve:
            rows.append("  curve: " + ", ".join(f"{k} {v:.4g}" for k, v in r.curve.items()))
        for seed, why in sorted(r.failed_seeds.items()):
            tail = next((x.log_tail for x in reversed(ctx.launches) if x.proposal_id == p.id and x.seed == seed
                         and x.log_tail), "")
            rows.append(f"  seed {seed} has no score: {why}" + (f"; log: {_tail(tail)}" if tail else ""))
    return "\n".join(rows)


def _rank(ctx: PlanContext, p: Proposal) -> float:
    """How good an experiment was, higher better whatever the direction: its effect, else its mean."""
    r = ctx.result(p.id)
    sign = 1.0 if ctx.brief.objective.direction == "maximize" else -1.0
    if r is None:
        return -math.inf
    if r.verdict is not None and r.verdict.effect is not None:
        return sign * r.verdict.effect
    return sign * r.summary.mean if r.summary and r.summary.n else -math.inf


def _describe_history(ctx: PlanContext) -> str:
    """Every experiment, cut to the brief's history budget: the best few first, then newest first."""
    if not ctx.proposals:
        return "(no experiments yet)"
    best = sorted((p for p in ctx.proposals if _rank(ctx, p) > -math.inf), key=lambda p: _rank(ctx, p),
                  reverse=True)[:_BEST_FIRST]
    order = best + [p for p in reversed(ctx.proposals) if p not in best]
    budget = ctx.brief.planner.llm.history_tokens * _CHARS_PER_TOKEN
    rows: list[str] = []
    for p in order:
        row = _describe_experiment(ctx, p)
        if rows and sum(len(x) for x in rows) + len(row) > budget:
            break
        rows.append(row)
    left_out = len(order) - len(rows)
    if left_out:
        rows.append(f"({left_out} older experiment(s) left out to fit the history budget)")
    return "\n".join(rows)


def _describe_baseline(ctx: PlanContext) -> str:
    """The references scored so far (base config or a code change's own overrides, at the base or a parent's
    code). What a baseline is and how proposals are judged against it is said once, in SYSTEM: the prompt
    must fit small contexts (tiny's 2048 byte-level tokens)."""
    rows: list[str] = []
    for p in ctx.proposals:
        r = ctx.result(p.id)
        if not is_reference(p, ctx.base_values) or p.extends or r is None:
            continue
        seeds = ", ".join(f"{s}: {v:.4g}" for s, v in sorted(r.seed_scores.items())) or "none"
        steps = p.steps(ctx.base_steps)
        config = {k: v for k, v in p.overrides.items() if k != "trainer.steps" and ctx.base_values.get(k) != v}
        code = f" at the code of {p.parent}" if p.parent else ""
        rows.append(f"- {p.id}, {steps} steps{f', {config}' if config else ''}{code}: {ctx.brief.objective.metric} = "
                    f"{r.summary.fmt() if r.summary else r.status}; per seed {{{seeds}}}")
    if not rows:
        rows.append("(no baseline scored yet: it runs with this round)")
    return "\n".join(rows)


def build_messages(ctx: PlanContext) -> list[dict[str, str]]:
    brief = ctx.brief
    system = SYSTEM.format(format=FORMAT, n=brief.planner.llm.proposals_per_round)
    user = (f"# Brief\n{brief.title}\n{brief.body}\n\n"
            f"# Objective\n{brief.objective.direction} {brief.objective.metric}\n\n"
            f"# Search space\n{_describe_space(ctx)}\n\n"
            f"# Budget left\nruns {ctx.runs_left}, trainer steps {ctx.steps_left} "
            f"(an experiment runs {len(brief.seeds)} seed(s) of {ctx.base_steps} steps)\n\n"
            f"# Baseline\n{_describe_baseline(ctx)}\n\n"
            f"# History\n{_describe_history(ctx)}\n\n"
            + (f"{code}\n\n" if (code := describe_code(ctx)) else "") +
            f"Plan round {ctx.round}.")  # SYSTEM already asks for the JSON object alone
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def extract_json(text: str) -> Any:
    """The JSON object in a reply, tolerating code fences and prose around it."""
    fenced = _FENCE.search(text)
    candidate = fenced.group(1) if fenced else text
    start, end = candidate.find("{"), candidate.rfind("}")
    if start < 0 or end <= start:
        raise ValueError("the reply contains no JSON object")
    try:
        return json.loads(candidate[start:end + 1])
    except json.JSONDecodeError as e:
        raise ValueError(f"the reply is not valid JSON: {e}") from None


def check_plan(plan: LlmPlan, ctx: PlanContext) -> None:
    """Semantic checks pydantic cannot do: the space, code areas and vetoes."""
    params, areas = ctx.brief.config_params(), ctx.brief.code_areas()
    vetoed = [p.overrides for p in ctx.proposals
              if (d := ctx.verdict(p.id)) is not None and d.verdict == "vetoed" and not p.needs_code_change]
    # Configurations already run (config-only proposals with a result) -> the proposal that ran them.
    ran = {json.dumps(p.overrides, sort_keys=True): p.id for p in ctx.proposals
           if p.kind == "config" and not p.needs_code_change and ctx.result(p.id) is not None}
    known = {p.id for p in ctx.proposals}
    problems = []
    if len(plan.proposals) > ctx.brief.planner.llm.proposals_per_round:
        problems.append(f"at most {ctx.brief.planner.llm.proposals_per_round} proposals are allowed")
    for i, draft in enumerate(plan.proposals):
        for key, value in draft.overrides.items():
            param = params.get(key)
            if param is None:
                problems.append(f"proposals[{i}].overrides: {key!r} is not a search-space key "
                                f"(allowed: {sorted(params)})")
            elif not param.contains(value):
                problems.append(f"proposals[{i}].overrides.{key}: {value!r} is outside the search space")
        if draft.needs_code_change != bool(draft.code_change):
            problems.append(f"proposals[{i}]: needs_code_change and code_change must agree")
        if draft.edits and (ctx.brief.code is None or not draft.needs_code_change):
            problems.append(f"proposals[{i}]: edits need needs_code_change=true and a brief with a code: section")
        if draft.code_change and draft.code_change.split(":", 1)[0].strip() not in areas:
            problems.append(f"proposals[{i}].code_change must start with a code area: {sorted(areas)}")
        if not draft.needs_code_change and draft.overrides in vetoed:
            problems.append(f"proposals[{i}] repeats a vetoed configuration {draft.overrides}")
        elif not draft.needs_code_change and not draft.edits and (
                done := ran.get(json.dumps(draft.overrides, sort_keys=True))):
            problems.append(f"proposals[{i}] repeats {done}, already run with {draft.overrides}: "
                            "propose something not yet tried")
        if draft.parent is not None and draft.parent not in known:
            problems.append(f"proposals[{i}].parent: {draft.parent!r} is not an earlier proposal id")
        elif draft.parent is not None and draft.edits and (
                why := parent_problem(draft.parent, ctx.proposals, ctx.decisions, ctx.code)):
            problems.append(f"proposals[{i}].parent: {why}; edits build only on an approved, executed code "
                            "proposal (or on the base: parent null)")
    if problems:
        raise ValueError("; ".join(problems))


class LlmPlanner:
    def __init__(self, base_url: str, model: str | None, api_key: str | None = None) -> None:
        """`model` None: the endpoint's single served model (read when the first plan is asked for)."""
        self.endpoint = Endpoint(base_url, model, api_key)

    @property
    def name(self) -> str:
        return f"llm:{self.endpoint.model or 'served-model'}"

    def plan(self, ctx: PlanContext) -> PlanResult:
        settings = ctx.brief.planner.llm
        messages = build_messages(ctx)
        tokens, errors, repairs = 0, [], 0
        for attempt in range(1, 2 * settings.max_retries + 2):  # invalid replies and edit repairs, each bounded
            if len(errors) > settings.max_retries:
                break
            if tokens >= ctx.tokens_left:
                return PlanResult([], done=True, tokens=tokens,
                                  note=f"{self.name}: LLM token budget exhausted ({ctx.brief.budget.llm_tokens})")
            try:
                reply = self.endpoint.complete(messages, min(settings.max_tokens, max(64, ctx.tokens_left - tokens)),
                                               settings.temperature, PLAN_SCHEMA)
            except PlannerError as e:  # the prompt cannot fit: what earlier attempts spent is still spent
                raise PlannerError(str(e), tokens=tokens + e.tokens) from None
            except openai.APIError as e:
                tokens += error_usage(e)  # a server may have generated (and billed) before it failed
                errors.append(f"attempt {attempt}: endpoint error: {e}")
                log.warning("llm planner attempt %d failed: %s", attempt, e)
                continue
            text = (reply.choices[0].message.content or "") if reply.choices else ""
            if reply.usage is not None:
                tokens += reply.usage.total_tokens
            else:
                tokens += (sum(len(m["content"]) for m in messages) + len(text)) // _CHARS_PER_TOKEN
            try:
                plan = LlmPlan.model_validate(extract_json(text))
                check_plan(plan, ctx)
            except (ValueError, ValidationError) as e:
                error = str(e)
                errors.append(f"attempt {attempt}: {error}")
                log.warning("llm planner attempt %d gave invalid output: %s", attempt, error)
                messages = messages + [
                    {"role": "assistant", "content": text[:_ECHO_CHARS]},
                    {"role": "user", "content": f"That reply was invalid: {error}\nReply with only the JSON object."}]
                continue
            repair = edit_problems(plan.proposals, ctx)
            if repair and repairs < settings.max_retries:  # bounded: after that, validation marks it invalid
                repairs += 1
                log.warning("llm planner edit repair %d: %s", repairs, repair.splitlines()[0])
                messages = messages + [
                    {"role": "assistant", "content": text[:_ECHO_CHARS]},
                    {"role": "user", "content": f"Some edits cannot apply: {repair}\nReply with the corrected JSON "
                                                "object only."}]
                continue
            return self._result(plan, ctx, tokens, attempt)
        raise PlannerError(f"{self.name} gave no valid plan after {settings.max_retries + 1} attempts "
                           f"({tokens} tokens spent):\n  " + "\n  ".join(errors), tokens=tokens)

    def _result(self, plan: LlmPlan, ctx: PlanContext, tokens: int, attempt: int) -> PlanResult:
        planned, runs_left, steps_left = [], ctx.runs_left, ctx.steps_left
        for draft in sorted(plan.proposals, key=lambda d: d.priority):
            runs, steps = ctx.cost(ctx.base_steps)
            if runs > runs_left or steps > steps_left:
                break
            runs_left, steps_left = runs_left - runs, steps_left - steps
            planned.append(Planned(draft))
        dropped = len(plan.proposals) - len(planned)
        note = f"{self.name}: {len(planned)} proposal(s) on attempt {attempt}, {tokens} tokens"
        if dropped:
            note += f"; {dropped} left out for budget"
        if plan.stop or not planned:
            note += f"; stop: {plan.stop_reason or 'nothing fits the budget'}"
        return PlanResult(planned, done=not planned, note=note, tokens=tokens)
