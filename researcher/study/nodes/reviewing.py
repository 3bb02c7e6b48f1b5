"""The review node: publish the round's proposals on the review board and wait for decisions.

Config proposals and validated code proposals wait for a person unless the brief's approval
policy auto-approves them within budget (`approval.config_only`, `approval.code_change`); the
baselines the study's rule adds and the replication stages (`researcher.evidence.baselines`) are
approved by policy. Code
proposals that failed validation are published as `invalid`, with their log, and are never put
to a person. Waiting is a LangGraph `interrupt()`; the runner resumes it with the decisions.
Edits of already decided proposals' tags are recorded as ignored (`ReviewBoard.audit`) each round.
"""

from __future__ import annotations

from typing import Any

from langgraph.types import interrupt

from researcher.budget import Spent
from researcher.evidence import baselines
from researcher.records import Decision
from researcher.study.nodes.base import NodeBase, StudyState, dump
from researcher.study.nodes.code import versions

AUTO_REASON = "config-only change within budget: auto-approved by the brief's approval policy"
AUTO_CODE_REASON = "validated code change within budget: auto-approved by the brief's approval policy"


class ReviewNode(NodeBase):
    def review(self, state: StudyState) -> dict[str, Any]:
        self._enter("review", state)
        brief, ctx = self.ctx.brief, self.ctx
        current, verdicts, code = self._current(state), self._verdicts(state), versions(state)
        for change in ctx.board.audit(list(verdicts.values())):
            ctx.emit("review.ignored", **change.model_dump())
        for p in current:
            ctx.board.publish(p, self.base_flat, code.get(p.id))
        ctx.emit("review.published", ids=[p.id for p in current])
        undecided = [p for p in current if p.id not in verdicts and (p.id not in code or code[p.id].passed)]
        new: dict[str, Decision] = {d.proposal_id: d for d in ctx.board.collect([p.id for p in undecided])}
        runs_left, steps_left, _ = Spent.of(state).left(brief)
        for p in undecided:
            runs = len(p.seeds or brief.seeds)
            steps = runs * self._steps(p)
            fits = runs <= runs_left and steps <= steps_left
            if policy := baselines.policy_reason(p):  # a reference or more seeds: nothing new for a person
                auto, reason = fits, policy
            elif p.kind == "code":
                auto, reason = brief.approval.code_change == "auto" and fits, AUTO_CODE_REASON
            else:
                auto = brief.approval.config_only == "auto" and not p.needs_code_change and fits
                reason = AUTO_REASON
            if p.id not in new and auto:
                runs_left, steps_left = runs_left - runs, steps_left - steps
                decision = Decision(proposal_id=p.id, verdict="approved", by="policy", reason=reason, source="policy")
                ctx.board.decide(decision)
                new[p.id] = decision
        waiting = [p.id for p in undecided if p.id not in new]
        if waiting:
            ctx.emit("review.pending", ids=waiting)
            answer = interrupt({"study": ctx.name, "pending": waiting})
            for raw in answer or []:
                d = Decision.model_validate(raw)
                if d.proposal_id in waiting and d.proposal_id not in new:
                    new[d.proposal_id] = d
        ordered = [new[p.id] for p in undecided if p.id in new]
        for d in ordered:
            ctx.emit("decision", **d.model_dump())
        return {"decisions": [*state.get("decisions", []), *dump(ordered)]}
