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

from researcher.evidence import baselines
from researcher.code.lineage import lineage, parent_ended, parent_problem
from researcher.evidence.study_view import Study
from researcher.records import Decision, Proposal
from researcher.study.nodes.base import NodeBase, StudyState, dump

AUTO_REASON = "config-only change within budget: auto-approved by the brief's approval policy"
AUTO_CODE_REASON = "validated code change within budget: auto-approved by the brief's approval policy"


class ReviewNode(NodeBase):
    def review(self, state: StudyState) -> dict[str, Any]:
        self._enter("review", state)
        brief, ctx = self.ctx.brief, self.ctx
        study = self._study(state)
        current, verdicts, code, proposals = study.current, study.verdicts, study.versions, list(study.proposals)
        for change in ctx.board.audit(list(verdicts.values())):
            ctx.emit("review.ignored", **change.model_dump())
        for p in current:  # a proposal on a parent is shown whole: its chain and its diff against the base
            chained = (lineage(p.id, proposals, code.get(p.id), ctx.workspace.root, state.get("workspace_base", ""))
                       if p.parent and ctx.workspace is not None else None)
            ctx.board.publish(p, self.base_flat, code.get(p.id), chained)
        ctx.emit("review.published", ids=[p.id for p in current])
        undecided = [p for p in current if p.id not in verdicts and (p.id not in code or code[p.id].passed)]
        new: dict[str, Decision] = {d.proposal_id: d for d in ctx.board.collect([p.id for p in undecided])}
        runs_left, steps_left, _ = study.spent().left(brief)
        for p in undecided:
            runs = len(p.seeds or brief.seeds)
            steps = runs * study.steps(p)
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
        new = self._parents_hold(study, undecided, new)  # before waiting: a vetoed parent's children end now
        waiting = [p.id for p in undecided if p.id not in new]
        if waiting:
            ctx.emit("review.pending", ids=waiting)
            answer = interrupt({"study": ctx.name, "pending": waiting})
            for raw in answer or []:
                d = Decision.model_validate(raw)
                if d.proposal_id in waiting and d.proposal_id not in new:
                    new[d.proposal_id] = d
        new = self._parents_hold(study, undecided, new)  # and for the answers a wait brought
        ordered = [new[p.id] for p in undecided if p.id in new]
        for d in ordered:
            ctx.emit("decision", **d.model_dump())
        return {"decisions": [*state.get("decisions", []), *dump(ordered)]}

    def _parents_hold(self, study: Study, undecided: list[Proposal], new: dict[str, Decision]) -> dict[str, Decision]:
        """No approval reaches a code proposal whose parent is not approved and executed, and a veto of a
        parent ends its children: either way the child is vetoed by the study with the reason (on its run,
        over any approval a person gave). Validation already refuses such children; this holds for any
        that got here another way (a study validated before the rule)."""
        proposals = list(study.proposals)
        decided = [*study.decisions, *new.values()]
        code = list(study.versions.values())
        out = dict(new)
        for p in undecided:
            if p.kind != "code" or not p.parent or (p.id in new and new[p.id].verdict == "vetoed"):
                continue
            others = [d for d in decided if d.proposal_id != p.id]
            problem = parent_problem(p.parent, proposals, others, code)
            if problem is None:
                continue
            if p.id not in new and not parent_ended(p.parent, others, code):
                continue  # still waiting, and its parent may yet be approved and run: it stays pending
            what = "its approval is refused" if p.id in new else "it ends"
            veto = Decision(proposal_id=p.id, verdict="vetoed", by="study", source="policy",
                            reason=f"{what}: {problem}")
            self.ctx.board.overrule(veto, refused=new.get(p.id))
            out[p.id] = veto
        return out
