"""The plan node: the planner's proposals for the next round, plus any people proposed.

People's proposals (`researcher study propose`) come from the study's inbox and join the round
next to the planner's. With the `manual` planner the study proposes nothing itself: the node
waits, polling the inbox, until someone proposes (days if need be) or the study is stopped.
When the search is over (the planner has nothing more, or the rounds or budget ran out) and it
has a recommendation, the node plans the confirmation round instead of stopping: the pick and
the baseline at full length on held-out seeds (`researcher.evidence.confirmation`), and while the search's
best comparison or the confirmation is inconclusive, a replication stage of more seeds for both of its
arms, within the budget (`researcher.evidence.stages`). A failed planner round
is retried with backoff (`researcher.planner.retry`); after `planner.llm.max_failed_rounds` in a row
the search ends the same way, every failed round's tokens counted against the budget; a planner
that never spent anything (an unreachable endpoint) stops the study, to be resumed. Every stop reason ends
with what the study may recommend. Whatever the planner, the round also gets the baselines its proposals need and no earlier
round ran (`researcher.evidence.baselines`). It plans; it does not validate, review or launch.
"""

from __future__ import annotations

import time
from typing import Any

from researcher.budget import Spent
from researcher.evidence import baselines, confirmation, stages
from researcher.evidence.study_view import Study
from researcher.planner.retry import plan_with_retries
from researcher.planner.types import PlanContext
from researcher.records import Proposal
from researcher.study import inbox
from researcher.study.nodes.base import NodeBase, StudyState, dump

MANUAL = "manual"


def from_person(item: inbox.PersonProposal, number: int) -> Proposal:
    return Proposal(id=item.id, round=number, planner=f"person:{item.by}", hypothesis=item.hypothesis,
                    rationale=f"proposed by {item.by} at {item.at}", expected_effect="as the hypothesis states",
                    overrides=item.overrides, patch=item.patch, parent=item.parent,
                    proposed_by=item.by, mode="hot_swap" if item.hot_swap else "runs")


class PlanNode(NodeBase):
    def _people(self, state: StudyState) -> list[inbox.PersonProposal]:
        known = {p["id"] for p in state.get("proposals", [])}
        return inbox.pending(self.ctx.paths.inbox, known)

    def load_brief(self, state: StudyState) -> dict[str, Any]:
        self._enter("load_brief", state)
        return {"study": self.ctx.name, "round": state.get("round", 0), "tokens_used": state.get("tokens_used", 0),
                "compute_s": state.get("compute_s", 0.0), "stop_reason": state.get("stop_reason", "")}

    def plan(self, state: StudyState) -> dict[str, Any]:
        self._enter("plan", state)
        # The live run first: what it spent is in the budget checked here (`researcher.runs.live_watch`).
        state = {**state, "live": self._watch_live(state)}
        update = self._plan(state)
        return {**update, "live": state["live"]}

    def _plan(self, state: StudyState) -> dict[str, Any]:
        """The plan node's answer; `state["live"]` is kept current while a manual study waits."""
        brief, ctx = self.ctx.brief, self.ctx
        study = self._study(state)
        spent = study.spent(gpus=brief.launch.gpus)
        stop = (f"budget: {brief.budget.max_rounds} rounds done" if study.round >= brief.budget.max_rounds
                else spent.exhausted(brief, llm=ctx.planner.name.startswith("llm")))
        if stop:
            return self._evidence(state, study, stop)
        runs_left, steps_left, tokens_left = spent.left(brief)
        number = study.round + 1
        started = time.monotonic()
        people = self._people(state)
        if ctx.planner.name == MANUAL:
            if not people:
                ctx.emit("plan.waiting", inbox=str(ctx.paths.inbox), poll_s=brief.review.poll_s)
            while not people:  # a person's proposal is the only way on; `researcher study stop` ends the wait
                time.sleep(brief.review.poll_s)
                state["live"] = self._watch_live(state)  # a live run that stalls meanwhile is caught
                people = self._people(state)
            planned, note, tokens = [], f"manual: {len(people)} proposal(s) from people", 0
        else:
            pctx = PlanContext(brief=brief, base_values=self.base_values, base_steps=self.base_steps, round=number,
                               proposals=list(study.proposals), decisions=list(study.decisions),
                               results=list(study.results),
                               runs_left=runs_left, steps_left=steps_left, tokens_left=tokens_left,
                               code=list(study.code), code_files=self._code_files(state),
                               version_files=self._version_files(study), launches=list(study.launches))
            # A failed round is retried with backoff; after `max_failed_rounds` in a row the search ends as if
            # the planner had nothing more (people's proposals and a confirmation still run), its tokens
            # counted; one that never spent anything (the endpoint is down) stops the study, to be resumed.
            settings = brief.planner.llm
            result = plan_with_retries(ctx.planner, pctx, settings.max_failed_rounds, settings.failed_round_backoff_s,
                                       ctx.emit)
            planned, note, tokens = result.planned, result.note, result.tokens
        info = {"round": number, "planner": ctx.planner.name, "note": note, "tokens": tokens,
                "plan_s": time.monotonic() - started, "proposals": len(planned) + len(people)}
        ctx.emit("plan", **info)
        update: dict[str, Any] = {"notes": [*state.get("notes", []), info],
                                  "tokens_used": state.get("tokens_used", 0) + tokens}
        fresh = [Proposal(**item.draft.model_dump(), id=f"r{number}-{i}", round=number, planner=ctx.planner.name,
                          arm=item.arm, rung=item.rung) for i, item in enumerate(planned, start=1)]
        fresh += [from_person(item, number) for item in people]
        # The baseline rule: whoever planned the round, each proposal judged against runs has its baseline.
        fresh += study.baselines_needed(fresh, number)
        if not fresh:
            return {**update, **self._evidence({**state, **update}, study, f"planner: {note}")}
        return {**update, "round": number, "proposals": [*state.get("proposals", []), *dump(fresh)]}

    def _evidence(self, state: StudyState, study: Study, why: str) -> dict[str, Any]:
        """The search is over: a replication stage when a comparison is inconclusive and the budget pays one,
        else the confirmation round owed, else the stop, saying what the study may recommend. `state` may carry
        the plan's notes and tokens beyond `study`; its records are the study's."""
        brief, number = self.ctx.brief, study.round + 1
        runs_left, steps_left, _ = Spent.of(state, gpus=brief.launch.gpus).left(brief)
        fresh = study.next_stage(number, runs_left, steps_left)
        if fresh:
            info = {"round": number, "planner": baselines.STAGE_PLANNER, "tokens": 0, "plan_s": 0.0,
                    "proposals": len(fresh), "note": f"{why}; {fresh[0].hypothesis}"}
            self.ctx.emit("plan", **info)
            return {"round": number, "notes": [*state.get("notes", []), info],
                    "proposals": [*state.get("proposals", []), *dump(fresh)]}
        owed = study.owed()
        if owed is not None:
            return self._confirm(state, study, owed, why)
        return {"stop_reason": self._concluded(study, why)}

    def _confirm(self, state: StudyState, study: Study, pick: Proposal, why: str) -> dict[str, Any]:
        """The confirmation round of the search's recommendation, or a stop when the budget cannot pay it."""
        brief, number = self.ctx.brief, study.round + 1
        runs_left, steps_left, _ = Spent.of(state, gpus=brief.launch.gpus).left(brief)
        looks = stages.confirmation_design(brief, runs_left, steps_left, self.base_steps)
        fresh = study.confirmation_round(pick, number, looks)
        runs = sum(len(p.seeds or []) for p in fresh)
        if runs > runs_left or runs * self.base_steps > steps_left:
            return {"stop_reason": self._concluded(study, f"{why}; the confirmation round ({runs} runs) does not fit "
                                                          "the budget left")}
        info = {"round": number, "planner": confirmation.CONFIRMATION_PLANNER, "tokens": 0, "plan_s": 0.0,
                "proposals": len(fresh), "note": f"{why}; confirming {pick.id} against the baseline on held-out "
                                                 f"seeds {fresh[0].seeds} at {self.base_steps} steps"
                                                 + (f", up to {len(looks)} looks ({looks} seeds per arm)" if looks else "")}
        self.ctx.emit("plan", **info)
        return {"round": number, "notes": [*state.get("notes", []), info],
                "proposals": [*state.get("proposals", []), *dump(fresh)]}

    def _code_files(self, state: StudyState) -> dict[str, str]:
        """The editable files at the base commit, whole (the prompt fits them to its budget, never cutting one)."""
        ws, spec = self.ctx.workspace, self.ctx.brief.code
        if ws is None or spec is None or not state.get("workspace_base"):
            return {}
        return self._editable(ws.files(state["workspace_base"]))

    def _editable(self, files: dict[str, str]) -> dict[str, str]:
        """Only what the brief lets the planner edit (a file-level entry's folder mates are read-only)."""
        spec = self.ctx.brief.code
        assert spec is not None
        return {n: t for n, t in sorted(files.items())
                if any(n == e or n.startswith(e + "/") for e in spec.editable)
                and not any(n == r or n.startswith(r + "/") for r in spec.readonly)}

    def _version_files(self, study: Study) -> dict[str, dict[str, str]]:
        """Each valid code version's files at its commit, whole: what a proposal on that parent edits."""
        ws = self.ctx.workspace
        if ws is None or self.ctx.brief.code is None:
            return {}
        return {v.proposal_id: self._editable(ws.files(v.commit))
                for v in study.code if v.passed and v.commit}
