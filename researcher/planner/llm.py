"""The llm planner: proposals as structured output from any OpenAI-compatible endpoint.

The model sees the brief, the search space, the budget left and every earlier proposal with its
result, decision and veto reason. It must answer with one JSON object that validates against
`LlmPlan`; the proposals must also stay inside the search space and must not repeat a vetoed
configuration. Invalid output is re-asked a bounded number of times with the error fed back, and
then fails with a clear `PlannerError`. Every token the endpoint reports is counted against the
brief's budget. The endpoint's own retries are off, so the brief's bound is the only one.

It plans; it does not review, launch, or apply code changes.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import openai
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from researcher.brief import ChoiceParam, RangeParam
from researcher.planner import Planned, PlanContext, PlannerError, PlanResult
from researcher.records import ProposalDraft

log = logging.getLogger(__name__)

# Bad output echoed back on a retry is cut to this many characters: enough to see the mistake,
# not enough to blow the context of a small model.
_ECHO_CHARS = 500
# Without a `usage` field from the server, tokens are estimated at this many characters each.
_CHARS_PER_TOKEN = 4
# A planning call that takes longer than this is treated as a failed attempt.
_TIMEOUT_S = 120.0
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


class LlmPlan(BaseModel):
    """The JSON object the model must return."""

    model_config = ConfigDict(extra="forbid")

    proposals: list[ProposalDraft] = Field(default_factory=list)
    stop: bool = False  # the model believes nothing more is worth trying
    stop_reason: str = ""


# The reply format as a compact example rather than a JSON schema dump: small models follow an
# example better, and the prompt must fit small contexts (the project's own `tiny` model: 2048).
FORMAT = ('{"proposals": [{"hypothesis": "...", "rationale": "...", "overrides": {"search.key": value}, '
          '"expected_effect": "...", "priority": 1, "needs_code_change": false, "code_change": null}], '
          '"stop": false, "stop_reason": ""}')

SYSTEM = """You plan experiments for a reinforcement-learning research study.
Reply with ONE JSON object and nothing else, shaped like:
{format}
Rules:
- `overrides` keys must be search-space keys; values must lie inside their range or choices.
- A code change sets needs_code_change=true and code_change="AREA: what to change", AREA being a
  code area of the search space. Code changes always wait for a human.
- priority: 1 (run first) to 10. Never repeat a configuration a reviewer vetoed; learn from the reasons.
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


def _describe_history(ctx: PlanContext) -> str:
    if not ctx.proposals:
        return "(no experiments yet)"
    rows = []
    for p in ctx.proposals:
        d, r = ctx.verdict(p.id), ctx.result(p.id)
        decision = f"{d.verdict} by {d.by}" + (f" ({d.reason})" if d.reason else "") if d else "pending"
        outcome = r.summary.fmt() if r and r.summary else (r.status if r else "not run")
        rows.append(f"- {p.id} {json.dumps(p.overrides)} code={p.code_change or '-'}: {decision}; "
                    f"{ctx.brief.objective.metric} = {outcome}. Hypothesis: {p.hypothesis}")
    return "\n".join(rows)


def build_messages(ctx: PlanContext) -> list[dict[str, str]]:
    brief = ctx.brief
    system = SYSTEM.format(format=FORMAT, n=brief.planner.llm.proposals_per_round)
    user = (f"# Brief\n{brief.title}\n{brief.body}\n\n"
            f"# Objective\n{brief.objective.direction} {brief.objective.metric}\n\n"
            f"# Search space\n{_describe_space(ctx)}\n\n"
            f"# Budget left\nruns {ctx.runs_left}, trainer steps {ctx.steps_left} "
            f"(an experiment runs {len(brief.seeds)} seed(s) of {ctx.base_steps} steps)\n\n"
            f"# History\n{_describe_history(ctx)}\n\n"
            f"Plan round {ctx.round}. Reply with the JSON object only.")
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
        if draft.code_change and draft.code_change.split(":", 1)[0].strip() not in areas:
            problems.append(f"proposals[{i}].code_change must start with a code area: {sorted(areas)}")
        if not draft.needs_code_change and draft.overrides in vetoed:
            problems.append(f"proposals[{i}] repeats a vetoed configuration {draft.overrides}")
    if problems:
        raise ValueError("; ".join(problems))


class LlmPlanner:
    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        self.name = f"llm:{model}"
        self.model = model
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none",
                                    max_retries=0, timeout=_TIMEOUT_S)

    def plan(self, ctx: PlanContext) -> PlanResult:
        settings = ctx.brief.planner.llm
        messages = build_messages(ctx)
        tokens, errors = 0, []
        for attempt in range(1, settings.max_retries + 2):
            if tokens >= ctx.tokens_left:
                return PlanResult([], done=True, tokens=tokens,
                                  note=f"{self.name}: LLM token budget exhausted ({ctx.brief.budget.llm_tokens})")
            try:
                reply = self.client.chat.completions.create(
                    model=self.model, messages=messages,  # type: ignore[arg-type]
                    temperature=settings.temperature,
                    max_tokens=min(settings.max_tokens, max(64, ctx.tokens_left - tokens)))
            except openai.APIError as e:
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
            return self._result(plan, ctx, tokens, attempt)
        raise PlannerError(f"{self.name} gave no valid plan after {settings.max_retries + 1} attempts "
                           f"({tokens} tokens spent):\n  " + "\n  ".join(errors))

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
