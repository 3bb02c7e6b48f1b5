"""Failed planning rounds: retried with backoff, and the search ends only after several in a row.

A planner round fails when it raises `PlannerError` (an LLM that gave no valid plan within its own
re-asks, or an endpoint that errs). One bad round (a transient overload, one confused reply) must
not end a study's search, so `plan_with_retries` runs the round again after a doubling backoff, up
to `planner.llm.max_failed_rounds` failed rounds in a row. The tokens every failed round spent still
count: they are added to the result (and taken off the next round's `tokens_left`). After the last
failure the search ends as if the planner had nothing more, unless no round spent anything (an
unreachable endpoint): then the error is raised, so the study stops to be resumed. This module only
retries; it neither plans nor decides what a plan means.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from researcher.planner.types import PlanContext, Planner, PlannerError, PlanResult

log = logging.getLogger(__name__)

BACKOFF_CAP_S = 300.0  # the longest wait between two failed rounds


def backoff_s(failures: int, base_s: float) -> float:
    """The wait after `failures` failed rounds in a row: base, 2 x base, 4 x base ... capped."""
    return min(BACKOFF_CAP_S, base_s * 2 ** (failures - 1))


def plan_with_retries(planner: Planner, ctx: PlanContext, max_failed_rounds: int, base_backoff_s: float,
                      emit: Callable[..., None] = lambda event, **kw: None,
                      sleep: Callable[[float], None] = time.sleep) -> PlanResult:
    """The planner's plan for `ctx`, retrying failed rounds; its `tokens` include the failed rounds'."""
    spent, failures = 0, 0
    while True:
        try:
            result = planner.plan(dataclasses.replace(ctx, tokens_left=max(0, ctx.tokens_left - spent)))
        except PlannerError as e:
            failures += 1
            spent += e.tokens
            if failures >= max_failed_rounds:
                if not spent:
                    raise  # nothing was spent (say the endpoint is down): the study stops here and resumes later
                return PlanResult([], done=True, tokens=spent,
                                  note=f"{planner.name} failed {failures} round(s) in a row: {e}")
            wait = backoff_s(failures, base_backoff_s)
            log.warning("%s: failed round %d of at most %d, retrying in %.1f s: %s", planner.name, failures,
                        max_failed_rounds, wait, str(e).splitlines()[0])
            emit("plan.retry", planner=planner.name, failures=failures, tokens=e.tokens, wait_s=wait,
                 error=str(e).splitlines()[0])
            sleep(wait)
            continue
        if spent:
            result = dataclasses.replace(result, tokens=result.tokens + spent,
                                         note=f"{result.note} (after {failures} failed round(s), {spent} tokens)")
        return result
