"""`make_planner`: the planner a study's `PlannerSpec` names, and the manual planner that plans nothing.

It imports every planner at module level, so importing it loads the OpenAI SDK; the light commands
read specs from `researcher.planner.types` instead. It does not choose a spec (that is `choose_planner`).
"""

from __future__ import annotations

from researcher.planner.heuristic import HeuristicPlanner
from researcher.planner.llm import LlmPlanner
from researcher.planner.types import PlanContext, Planner, PlannerSpec, PlanResult


class ManualPlanner:
    """Plans nothing: the study runs what people propose (`researcher study propose`)."""

    name = "manual"

    def plan(self, ctx: PlanContext) -> PlanResult:
        return PlanResult([], note="manual: the study waits for people's proposals")


def make_planner(spec: PlannerSpec) -> Planner:
    if spec.kind == "manual":
        return ManualPlanner()
    if spec.kind == "llm":
        return LlmPlanner(base_url=spec.base_url or "", model=spec.model)
    return HeuristicPlanner()
