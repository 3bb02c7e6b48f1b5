"""The outcome nodes: score finished experiments, decide whether to go on, and write the report.

`analyze` reads each experiment's runs from MLflow, queues the one re-run of each failed seed (a
reference arm's, one fresh retry more), scores the experiments over seeds and judges each against
its matching reference (`researcher.evidence.judging`), a seed a plateau stopped scored at the same
step in both arms (it reads the other arm's run there), then carries each replication stage's look
onto the comparison it extends (`researcher.evidence.stages`, `researcher.evidence.confirmation`);
`decide` checks the budgets (a confirmation round or a replication stage owed still runs);
`report` renders the study so far. They start and stop nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from researcher.evidence import analysis, confirmation, judging, pairing, stages
from researcher.records import COST_METRICS, Launch
from researcher.review.report import write_report
from researcher.study.nodes.base import NodeBase, StudyState, dump


class OutcomeNodes(NodeBase):
    def _read(self, launches: Sequence[Launch]) -> tuple[dict[str, analysis.RunScore], dict[str, list[dict[str, Any]]]]:
        """Each launch's outcome, and the metric histories of each proposal's finished runs."""
        objective = self.ctx.brief.objective
        metrics = [objective.metric, "train/loss", *analysis.CURVE_DIAGNOSTICS.values(), *COST_METRICS.values()]
        outcomes: dict[str, analysis.RunScore] = {}
        curves: dict[str, list[dict[str, Any]]] = {}
        for x in launches:
            plateau = x.status == "stopped" and x.reason.startswith(analysis.PLATEAU)  # scored at its stop
            if (x.status == "finished" or plateau) and x.run_id:
                run = analysis.read_run(self.ctx.client, x.run_id, metrics)
                outcome = analysis.run_outcome(x, run.histories[objective.metric], objective, run.last_step)
                outcomes[x.key] = replace(outcome, cost=analysis.run_cost(run.histories))
                curves.setdefault(x.proposal_id, []).append(run.histories)
            else:
                outcomes[x.key] = analysis.run_outcome(x, None, objective)
        return outcomes, curves

    def _score_at(self, launches: Sequence[Launch]) -> pairing.ScoreAt:
        """(proposal, seed, step) -> that run's score at the step, read from MLflow once per run: a seed a
        plateau stopped in one arm is scored at the same step in the other (researcher.evidence.pairing)."""
        cache: dict[str, analysis.History] = {}
        objective = self.ctx.brief.objective

        def score_at(proposal_id: str, seed: int, step: int) -> float | None:
            mine = [x for x in launches if x.proposal_id == proposal_id and x.seed == seed and x.run_id]
            if not mine:
                return None
            run_id = max(mine, key=lambda x: x.attempt).run_id
            assert run_id is not None
            if run_id not in cache:
                cache[run_id] = analysis.read_history(self.ctx.client, run_id, objective.metric)
            history = [(s, v) for s, v in cache[run_id] if s <= step]
            if not history or history[-1][0] != step:
                return None  # no value logged at the stop step: no fair score
            value = analysis.score(history, objective)
            return None if math.isnan(value) else value  # not finite there: no fair score

        return score_at

    def analyze(self, state: StudyState) -> dict[str, Any]:
        self._enter("analyze", state)
        brief, ctx = self.ctx.brief, self.ctx
        study = self._study(state)
        launches, results, proposals = study.launches, list(study.results), list(study.proposals)
        done = {r.proposal_id for r in results}
        pending = [pid for pid in dict.fromkeys(x.proposal_id for x in launches) if pid not in done]
        outcomes, curves = self._read([x for x in launches if x.proposal_id in pending])
        mine = {pid: [x for x in launches if x.proposal_id == pid] for pid in pending}
        # An arm some proposal is judged against gets one fresh retry more for a lost seed: they all pay for it.
        refs = {ref.id for q in proposals if not study.is_reference(q) for ref in study.references_of(q)}
        reruns = [r for pid in pending for r in analysis.seed_table(mine[pid], outcomes, reference=pid in refs)[2]]
        if reruns:  # a failed seed is re-run once (resumed from its checkpoint) before anything is judged
            runs_left, steps_left, _ = study.spent().left(brief)
            for i, x in enumerate(reruns):
                if i >= runs_left or steps_left < x.steps * (i + 1):
                    reruns[i] = x.model_copy(update={"status": "skipped", "reason": "budget"})
            ctx.emit("rerun", keys=[x.key for x in reruns])
            return {"launches": dump([*launches, *reruns])}
        new = [analysis.experiment_result(pid, mine[pid], outcomes).model_copy(
            update={"curve": analysis.curve_summary(curves.get(pid, []), brief.objective)}) for pid in pending]
        # A baseline run again (its earlier arm failed) is the reference of candidates that waited on it: they
        # are judged again with the round's own, in one Holm family per reference.
        again = judging.waiting(new, results, proposals, self.base_values, self.base_steps)
        judged = analysis.judge([*new, *again], proposals, self.base_values, self.base_steps, brief.objective,
                                known=results, score_at=self._score_at(launches), boundary=brief.replicate.boundary)
        new, rejudged = judged[:len(new)], {r.proposal_id: r for r in judged[len(new):]}
        for r in rejudged.values():
            ctx.emit("result.rejudged", proposal_id=r.proposal_id, verdict=r.verdict.fmt() if r.verdict else "")
        results = [rejudged.get(r.proposal_id, r) for r in results]
        results = stages.attach(confirmation.attach([*results, *new], proposals, self.base_values), proposals)
        for r in new:
            verdict = r.verdict.fmt() if r.verdict else ""
            note = "; ".join(x for x in (verdict, r.note) if x)
            ctx.board.close(r.proposal_id, r.summary, "FINISHED" if r.status == "ok" else "FAILED", note)
            ctx.emit("result", proposal_id=r.proposal_id, status=r.status,
                     summary=r.summary.fmt() if r.summary else "n/a", verdict=verdict)
        ended = [x.ended_at for x in launches if x.ended_at]
        compute = state.get("compute_s", 0.0)
        if state.get("round_started") and ended:
            compute += max(0.0, max(ended) - float(state["round_started"]))
        return {"results": dump(results), "compute_s": compute, "round_started": None}

    def decide(self, state: StudyState) -> dict[str, Any]:
        self._enter("decide", state)
        brief = self.ctx.brief
        live = self._watch_live(state)  # what the live run spent, to its last sign of life
        state = {**state, "live": live}
        study = self._study(state)
        owed = study.evidence_owed()
        if study.round >= brief.budget.max_rounds and not owed:
            rounds = f"budget: {brief.budget.max_rounds} rounds done"
            return {"live": live, "stop_reason": self._concluded(study, rounds)}
        stop = study.spent(gpus=brief.launch.gpus).exhausted(brief, llm=self.ctx.planner.name.startswith("llm"))
        if stop and owed:
            return {"live": live, "stop_reason": ""}  # the plan node runs the confirmation or stage, or stops
        return {"live": live, "stop_reason": self._concluded(study, stop) if stop else ""}

    def report(self, state: StudyState) -> dict[str, Any]:
        self._enter("report", state)
        board, study = self.ctx.board, self._study(state)
        for change in board.audit(list(study.decisions)):
            self.ctx.emit("review.ignored", **change.model_dump())
        path = write_report(self.ctx.name, self.ctx.brief, dict(state), self.ctx.client, self.ctx.paths,
                            self.base_flat, board.ignored())
        self.ctx.emit("report", path=str(path))
        update: dict[str, Any] = {"report": str(path)}
        if study.live is not None:  # the study is over: so is its live run (researcher/study/nodes/live.py)
            live = self.ctx.launcher.stop(study.live, "the study ended", self.ctx.client)
            update["live"] = live.model_dump()
        return update
