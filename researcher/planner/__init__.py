"""Planners: what to try next, given the brief and everything the study has seen so far.

A planner is a `plan(PlanContext) -> PlanResult` object. `heuristic` is an offline successive-
halving search; `llm` asks any OpenAI-compatible endpoint for structured proposals. The shared
types are `researcher.planner.types`, the choice between planners `researcher.planner.factory`.
Planners do not review, launch or record.
"""
