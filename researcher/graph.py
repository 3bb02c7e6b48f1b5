"""The study graph: LangGraph nodes and edges from brief to report, looping over rounds.

    load_brief -> plan -> review (loops while decisions are pending) -> prepare -> launch
                   ^                                                              |
                 decide <- analyze <- monitor (loops to launch while runs are queued) <-
                   | stop
                 report

State is plain JSON (records dumped to dicts) so the SqliteSaver checkpoint is readable and
version-proof. Every node is idempotent: it recomputes its answer from the state and looks up
what it already did outside (proposal runs on MLflow, launch intents, finished runs) before
acting. Review waits through `interrupt()`; the runner resumes it with `Command(resume=decisions)`.
The graph does not own processes, poll for decisions, or print: the runner and CLI do.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import yaml
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt
from mlflow.tracking import MlflowClient

from core.config import ConfigError, flatten
from researcher import analysis
from researcher.brief import Brief
from researcher.budget import Spent
from researcher.launcher import Emit, Launcher
from researcher.planner import Planner, PlanContext
from researcher.records import TERMINAL, Decision, ExperimentResult, Launch, Proposal
from researcher.review import ReviewBoard
from researcher.store import StudyPaths

log = logging.getLogger(__name__)

AUTO_REASON = "config-only change within budget: auto-approved by the brief's approval policy"
NO_WORKSPACE = "approved code change not run: applying code edits (the workspace) is not built yet"


class StudyState(TypedDict, total=False):
    study: str
    round: int  # rounds planned so far
    proposals: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    launches: list[dict[str, Any]]
    results: list[dict[str, Any]]
    notes: list[dict[str, Any]]  # per plan: round, planner, note, tokens, seconds spent planning
    tokens_used: int
    compute_s: float  # wall-clock of finished rounds (launch to last run end)
    round_started: float | None  # when the current round's first run started
    stop_reason: str
    report: str


@dataclass
class StudyContext:
    """Everything the nodes need that is not state: the outside world, built by the runner."""

    name: str
    brief: Brief
    paths: StudyPaths
    workdir: Path
    client: MlflowClient
    board: ReviewBoard
    launcher: Launcher
    planner: Planner
    emit: Emit


def _models(items: list[dict[str, Any]] | None, cls: type) -> list[Any]:
    return [cls.model_validate(x) for x in items or []]


def _dump(items: list[Any]) -> list[dict[str, Any]]:
    return [x.model_dump() for x in items]


def typed_values(cfg_dump: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A dumped run config as `a.b.c -> value` with the values' own types (planners compare them)."""
    out: dict[str, Any] = {}
    for key, value in cfg_dump.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(typed_values(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                out.update(typed_values(v, f"{name}.{i}."))
        else:
            out[name] = value
    return out


class StudyNodes:
    def __init__(self, ctx: StudyContext) -> None:
        self.ctx = ctx
        base = ctx.brief.resolve_config(ctx.workdir)
        self.base_flat = flatten(base)
        self.base_values = typed_values(base.model_dump())
        self.base_steps = base.trainer.steps

    # -- helpers ------------------------------------------------------------------------------
    def _current(self, state: StudyState) -> list[Proposal]:
        return [p for p in _models(state.get("proposals"), Proposal) if p.round == state.get("round", 0)]

    @staticmethod
    def _verdicts(state: StudyState) -> dict[str, Decision]:
        return {d.proposal_id: d for d in _models(state.get("decisions"), Decision)}

    def _enter(self, node: str, state: StudyState) -> None:
        self.ctx.emit("node", node=node, round=state.get("round", 0))

    # -- nodes --------------------------------------------------------------------------------
    def load_brief(self, state: StudyState) -> dict[str, Any]:
        self._enter("load_brief", state)
        return {"study": self.ctx.name, "round": state.get("round", 0), "tokens_used": state.get("tokens_used", 0),
                "compute_s": state.get("compute_s", 0.0), "stop_reason": state.get("stop_reason", "")}

    def plan(self, state: StudyState) -> dict[str, Any]:
        self._enter("plan", state)
        brief = self.ctx.brief
        spent = Spent.of(state)
        if state.get("round", 0) >= brief.budget.max_rounds:
            return {"stop_reason": f"budget: {brief.budget.max_rounds} rounds done"}
        stop = spent.exhausted(brief, llm=self.ctx.planner.name.startswith("llm"))
        if stop:
            return {"stop_reason": stop}
        runs_left, steps_left, tokens_left = spent.left(brief)
        number = state.get("round", 0) + 1
        pctx = PlanContext(brief=brief, base_values=self.base_values, base_steps=self.base_steps, round=number,
                           proposals=_models(state.get("proposals"), Proposal),
                           decisions=_models(state.get("decisions"), Decision),
                           results=_models(state.get("results"), ExperimentResult),
                           runs_left=runs_left, steps_left=steps_left, tokens_left=tokens_left)
        started = time.monotonic()
        result = self.ctx.planner.plan(pctx)
        note = {"round": number, "planner": self.ctx.planner.name, "note": result.note, "tokens": result.tokens,
                "plan_s": time.monotonic() - started, "proposals": len(result.planned)}
        self.ctx.emit("plan", **note)
        update: dict[str, Any] = {"notes": [*state.get("notes", []), note],
                                  "tokens_used": state.get("tokens_used", 0) + result.tokens}
        if not result.planned:
            update["stop_reason"] = f"planner: {result.note}"
            return update
        fresh = [Proposal(**planned.draft.model_dump(), id=f"r{number}-{i}", round=number,
                          planner=self.ctx.planner.name, arm=planned.arm, rung=planned.rung)
                 for i, planned in enumerate(result.planned, start=1)]
        return {**update, "round": number, "proposals": [*state.get("proposals", []), *_dump(fresh)]}

    def review(self, state: StudyState) -> dict[str, Any]:
        self._enter("review", state)
        current, verdicts = self._current(state), self._verdicts(state)
        for p in current:
            self.ctx.board.publish(p, p.diff_text(self.base_flat))
        self.ctx.emit("review.published", ids=[p.id for p in current])
        undecided = [p for p in current if p.id not in verdicts]
        new: dict[str, Decision] = {d.proposal_id: d for d in self.ctx.board.collect([p.id for p in undecided])}
        runs_left, steps_left, _ = Spent.of(state).left(self.ctx.brief)
        for p in undecided:
            runs, steps = len(self.ctx.brief.seeds), len(self.ctx.brief.seeds) * self._steps(p)
            auto = (self.ctx.brief.approval.config_only == "auto" and not p.needs_code_change
                    and runs <= runs_left and steps <= steps_left)
            if p.id not in new and auto:
                runs_left, steps_left = runs_left - runs, steps_left - steps
                decision = Decision(proposal_id=p.id, verdict="approved", by="policy", reason=AUTO_REASON,
                                    source="policy")
                self.ctx.board.decide(decision)
                new[p.id] = decision
        waiting = [p.id for p in undecided if p.id not in new]
        if waiting:
            self.ctx.emit("review.pending", ids=waiting)
            answer = interrupt({"study": self.ctx.name, "pending": waiting})
            for raw in answer or []:
                d = Decision.model_validate(raw)
                if d.proposal_id in waiting and d.proposal_id not in new:
                    new[d.proposal_id] = d
        ordered = [new[p.id] for p in undecided if p.id in new]
        for d in ordered:
            self.ctx.emit("decision", **d.model_dump())
        return {"decisions": [*state.get("decisions", []), *_dump(ordered)]}

    def _steps(self, p: Proposal) -> int:
        return int(p.overrides.get("trainer.steps", self.base_steps))

    def prepare(self, state: StudyState) -> dict[str, Any]:
        self._enter("prepare", state)
        verdicts = self._verdicts(state)
        launches = _models(state.get("launches"), Launch)
        results = _models(state.get("results"), ExperimentResult)
        known = {x.proposal_id for x in launches} | {r.proposal_id for r in results}
        runs_left, steps_left, _ = Spent.of(state).left(self.ctx.brief)
        runs_left -= sum(1 for x in launches if x.status == "queued")
        steps_left -= sum(x.steps for x in launches if x.status == "queued")
        approved = [p for p in self._current(state) if (d := verdicts.get(p.id)) and d.verdict == "approved"]
        for p in sorted(approved, key=lambda q: (q.priority, q.id)):
            if p.id in known:
                continue
            if p.needs_code_change:
                results.append(ExperimentResult(proposal_id=p.id, status="skipped", note=NO_WORKSPACE))
                self.ctx.board.close(p.id, None, "FINISHED", NO_WORKSPACE)
                continue
            try:
                config = self.ctx.brief.resolve_config(self.ctx.workdir, p.overrides)
            except ConfigError as e:
                results.append(ExperimentResult(proposal_id=p.id, status="failed", note=f"invalid run config: {e}"))
                self.ctx.board.close(p.id, None, "FAILED", f"invalid run config: {e}")
                continue
            self.ctx.paths.configs.mkdir(parents=True, exist_ok=True)
            config_path = self.ctx.paths.configs / f"{p.id}.yaml"
            config_path.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
            for seed in self.ctx.brief.seeds:
                launch = Launch(key=f"{p.id}-s{seed}", proposal_id=p.id, seed=seed, steps=config.trainer.steps,
                                config_path=str(config_path))
                if runs_left < 1 or steps_left < launch.steps:
                    launch = launch.model_copy(update={"status": "skipped", "reason": "budget"})
                else:
                    runs_left, steps_left = runs_left - 1, steps_left - launch.steps
                launches.append(launch)
        return {"launches": _dump(launches), "results": _dump(results)}

    def launch(self, state: StudyState) -> dict[str, Any]:
        self._enter("launch", state)
        launches = _models(state.get("launches"), Launch)
        running = sum(1 for x in launches if x.status == "running")
        round_started = state.get("round_started")
        for i, x in enumerate(launches):
            if x.status != "queued" or running >= self.ctx.brief.launch.concurrency:
                continue
            launches[i] = self.ctx.launcher.start(x, self.ctx.client)
            if launches[i].status == "running":
                running += 1
                round_started = round_started or launches[i].started_at
                self.ctx.board.mark_running(x.proposal_id)
        return {"launches": _dump(launches), "round_started": round_started}

    def monitor(self, state: StudyState) -> dict[str, Any]:
        self._enter("monitor", state)
        brief, ctx = self.ctx.brief, self.ctx
        launches = _models(state.get("launches"), Launch)
        metrics = [brief.objective.metric, *brief.monitor.divergence_metrics]
        while True:
            changed = False
            spent = Spent.of({**state, "launches": _dump(launches)})
            over = spent.wall_s >= brief.budget.wall_clock
            steps_seen = sum(x.steps_done for x in launches if x.status != "queued")
            for i, x in enumerate(launches):
                if x.status == "queued" and over:
                    launches[i] = x.model_copy(update={"status": "skipped", "reason": "budget: wall-clock"})
                    changed = True
                if x.status != "running":
                    continue
                x = ctx.launcher.poll(x, ctx.client)
                reason = "budget: wall-clock" if over else None
                if x.status == "running" and x.run_id:
                    run = analysis.read_run(ctx.client, x.run_id, metrics)
                    x = x.model_copy(update={"steps_done": run.last_step})
                    objective = run.histories[brief.objective.metric]
                    reason = reason or (analysis.divergence(run.histories)
                                        or analysis.collapse(objective, brief.objective, brief.monitor)
                                        or analysis.plateau(objective, brief.objective, brief.monitor))
                    if steps_seen > brief.budget.max_total_steps:
                        reason = reason or "budget: trainer steps"
                if x.status == "running" and reason:
                    ctx.emit("run.stopping", key=x.key, reason=reason)
                    x = ctx.launcher.stop(x, reason, ctx.client)
                if x.status in TERMINAL:
                    changed = True
                    ctx.emit("run.ended", key=x.key, status=x.status, reason=x.reason)
                launches[i] = x
            if changed or not any(x.status == "running" for x in launches):
                return {"launches": _dump(launches)}
            time.sleep(brief.monitor.poll_s)

    def analyze(self, state: StudyState) -> dict[str, Any]:
        self._enter("analyze", state)
        brief, ctx = self.ctx.brief, self.ctx
        launches = _models(state.get("launches"), Launch)
        results = _models(state.get("results"), ExperimentResult)
        done = {r.proposal_id for r in results}
        for pid in dict.fromkeys(x.proposal_id for x in launches):
            if pid in done:
                continue
            mine = [x for x in launches if x.proposal_id == pid]
            values = []
            for x in mine:
                if x.status in ("finished", "stopped") and x.run_id:
                    values.append(analysis.score(analysis.read_history(ctx.client, x.run_id, brief.objective.metric),
                                                 brief.objective))
            summary = analysis.summarize(values)
            failures = [f"{x.key}: {x.status} ({x.reason})" for x in mine if x.status != "finished"]
            status = "ok" if summary.n else ("skipped" if all(x.status == "skipped" for x in mine) else "failed")
            result = ExperimentResult(proposal_id=pid, status=status, values=[v for v in values if not math.isnan(v)],
                                      summary=summary, note="; ".join(failures))
            results.append(result)
            ctx.board.close(pid, summary, "FINISHED" if status == "ok" else "FAILED", result.note)
            ctx.emit("result", proposal_id=pid, status=status, summary=summary.fmt())
        ended = [x.ended_at for x in launches if x.ended_at]
        compute = state.get("compute_s", 0.0)
        if state.get("round_started") and ended:
            compute += max(0.0, max(ended) - float(state["round_started"]))
        return {"results": _dump(results), "compute_s": compute, "round_started": None}

    def decide(self, state: StudyState) -> dict[str, Any]:
        self._enter("decide", state)
        brief = self.ctx.brief
        if state.get("round", 0) >= brief.budget.max_rounds:
            return {"stop_reason": f"budget: {brief.budget.max_rounds} rounds done"}
        stop = Spent.of(state).exhausted(brief, llm=self.ctx.planner.name.startswith("llm"))
        return {"stop_reason": stop or ""}

    def report(self, state: StudyState) -> dict[str, Any]:
        self._enter("report", state)
        from researcher.report import write_report  # matplotlib is only needed here

        path = write_report(self.ctx.name, self.ctx.brief, dict(state), self.ctx.client, self.ctx.paths,
                            self.base_flat)
        self.ctx.emit("report", path=str(path))
        return {"report": str(path)}


# -- edges ------------------------------------------------------------------------------------
def _after_plan(state: StudyState) -> str:
    return "report" if state.get("stop_reason") else "review"


def _after_review(state: StudyState) -> str:
    decided = {d["proposal_id"] for d in state.get("decisions", [])}
    current = [p for p in state.get("proposals", []) if p["round"] == state.get("round", 0)]
    return "review" if any(p["id"] not in decided for p in current) else "prepare"


def _after_monitor(state: StudyState) -> str:
    statuses = [x["status"] for x in state.get("launches", [])]
    if "queued" in statuses:
        return "launch"
    return "monitor" if "running" in statuses else "analyze"


def _after_decide(state: StudyState) -> str:
    return "report" if state.get("stop_reason") else "plan"


NODES = ("load_brief", "plan", "review", "prepare", "launch", "monitor", "analyze", "decide", "report")


def _read_only(state: StudyState) -> dict[str, Any]:
    raise RuntimeError("this study graph was built for reading state; it cannot run nodes")


def build_graph(ctx: StudyContext | None) -> StateGraph:
    """The study graph; with ctx None, one whose nodes refuse to run (for reading checkpoints)."""
    nodes = StudyNodes(ctx) if ctx is not None else None
    g = StateGraph(StudyState)
    for name in NODES:
        g.add_node(name, getattr(nodes, name) if nodes is not None else _read_only)
    g.add_edge(START, "load_brief")
    g.add_edge("load_brief", "plan")
    g.add_conditional_edges("plan", _after_plan, ["review", "report"])
    g.add_conditional_edges("review", _after_review, ["review", "prepare"])
    g.add_edge("prepare", "launch")
    g.add_edge("launch", "monitor")
    g.add_conditional_edges("monitor", _after_monitor, ["launch", "monitor", "analyze"])
    g.add_edge("analyze", "decide")
    g.add_conditional_edges("decide", _after_decide, ["plan", "report"])
    g.add_edge("report", END)
    return g
