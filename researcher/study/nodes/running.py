"""The run nodes: turn approved proposals into launches, start them, and watch them to their end.

`prepare` writes each approved experiment's run config and one `Launch` per seed. In a study with
a code workspace every run executes the sandbox exactly at its proposal's commit (config-only
proposals at the base commit): its config points the client at `runs/<key>/code/...`, a folder
of its own the launcher checks that commit out into. `launch` starts queued runs within the
concurrency limit; `monitor` polls them (MLflow metrics, exit codes), stops the diverging,
collapsing, plateaued, over-budget and timed-out (`launch.run_timeout`) ones, ending them `stopped`,
and the stalled ones (no new step for `monitor.stall_s`), ending them `stalled`; it returns when
something ended. It watches the study's live run beside them (`researcher.runs.live_watch`), whose
steps and time count in the budget it checks.
They do not analyse results or decide what comes next.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from core.config import RunConfig
from core.config_io import ConfigError
from researcher.budget import Spent
from researcher.evidence import analysis
from researcher.records import TERMINAL, ExperimentResult, Launch
from researcher.study.nodes.base import NodeBase, StudyState, dump

NO_EDITS = "approved code change not run: it describes a change but carries no edits or patch to apply"
INVALID = "not run: the code change failed validation at step {step}"


class RunNodes(NodeBase):
    def _code_config(self, config: RunConfig, key: str) -> RunConfig:
        """The run config with every client of a workspace sandbox pointed at the run's own checkout."""
        ws = self.ctx.workspace
        assert ws is not None
        code = self.ctx.launcher.run_dir(key) / "code"
        clients = []
        for c in config.clients:
            rel = f"sandboxes/{c.agent.removeprefix('sandbox:')}" if c.agent.startswith("sandbox:") else c.agent
            if not Path(rel).is_absolute() and (ws.root / rel).is_dir():
                c = c.model_copy(update={"agent": str(code / rel)})
            clients.append(c)
        return config.model_copy(update={"clients": clients})

    def prepare(self, state: StudyState) -> dict[str, Any]:
        self._enter("prepare", state)
        ctx = self.ctx
        study = self._study(state)
        verdicts, code = study.verdicts, study.versions
        launches, results = list(study.launches), list(study.results)
        known = {x.proposal_id for x in launches} | {r.proposal_id for r in results}
        runs_left, steps_left, _ = study.spent().left(ctx.brief)
        runs_left -= sum(1 for x in launches if x.status == "queued")
        steps_left -= sum(x.steps for x in launches if x.status == "queued")
        for p in study.current:
            version = code.get(p.id)
            if p.id not in known and version is not None and not version.passed:
                note = INVALID.format(step=version.failed_step)
                results.append(ExperimentResult(proposal_id=p.id, status="failed", note=note))
                known.add(p.id)
        approved = [p for p in study.current if (d := verdicts.get(p.id)) and d.verdict == "approved"]
        for p in sorted(approved, key=lambda q: (q.priority, q.id)):
            if p.id in known or p.mode == "hot_swap":  # hot swaps go into the live run (the live node)
                continue
            if p.needs_code_change and p.kind != "code":
                results.append(ExperimentResult(proposal_id=p.id, status="skipped", note=NO_EDITS))
                ctx.board.close(p.id, None, "FINISHED", NO_EDITS)
                continue
            try:
                config = ctx.brief.resolve_config(ctx.workdir, p.overrides)
            except ConfigError as e:
                results.append(ExperimentResult(proposal_id=p.id, status="failed", note=f"invalid run config: {e}"))
                ctx.board.close(p.id, None, "FAILED", f"invalid run config: {e}")
                continue
            # Its own code version, else the commit it was given (a code pick's confirmation), else its parent's
            # (a parent's reference arm: the parent's code with a child's overrides), else the base.
            commit = code[p.id].commit if p.id in code else p.commit or state.get("workspace_base", "")
            if p.reference and p.parent:
                parent = code.get(p.parent)
                if parent is None or not parent.passed:
                    note = f"not run: the code of its parent {p.parent} did not pass validation"
                    results.append(ExperimentResult(proposal_id=p.id, status="failed", note=note))
                    ctx.board.close(p.id, None, "FAILED", note)
                    continue
                commit = parent.commit
            ctx.paths.configs.mkdir(parents=True, exist_ok=True)
            for seed in p.seeds or ctx.brief.seeds:  # a confirmation round runs held-out seeds
                key = f"{p.id}-s{seed}"
                run_config = self._code_config(config, key) if ctx.workspace is not None else config
                config_path = ctx.paths.configs / (f"{key}.yaml" if ctx.workspace is not None else f"{p.id}.yaml")
                config_path.write_text(yaml.safe_dump(run_config.model_dump(), sort_keys=False))
                launch = Launch(key=key, proposal_id=p.id, seed=seed, steps=config.trainer.steps,
                                config_path=str(config_path), commit=commit)
                if runs_left < 1 or steps_left < launch.steps:
                    launch = launch.model_copy(update={"status": "skipped", "reason": "budget"})
                else:
                    runs_left, steps_left = runs_left - 1, steps_left - launch.steps
                launches.append(launch)
        return {"launches": dump(launches), "results": dump(results)}

    def launch(self, state: StudyState) -> dict[str, Any]:
        self._enter("launch", state)
        launches = list(self._study(state).launches)
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
        return {"launches": dump(launches), "round_started": round_started}

    def monitor(self, state: StudyState) -> dict[str, Any]:
        self._enter("monitor", state)
        brief, ctx = self.ctx.brief, self.ctx
        launches = list(self._study(state).launches)
        metrics = [brief.objective.metric, *brief.monitor.divergence_metrics]
        live = state.get("live") or {}
        while True:
            changed = False
            # The live run is watched beside the proposals' runs, and what it spent counts here too.
            live = self._watch_live({**state, "launches": dump(launches), "live": live})
            spent = Spent.of({**state, "launches": dump(launches), "live": live})
            over = spent.wall_s >= brief.budget.wall_clock
            steps_seen = sum(x.steps_done for x in launches if x.status != "queued") + live.get("steps_done", 0)
            for i, x in enumerate(launches):
                if x.status == "queued" and over:
                    launches[i] = x.model_copy(update={"status": "skipped", "reason": "budget: wall-clock"})
                    changed = True
                if x.status != "running":
                    continue
                x = ctx.launcher.poll(x, ctx.client)
                reason = "budget: wall-clock" if over else None
                now = time.time()
                if x.status == "running" and x.run_id:
                    run = analysis.read_run(ctx.client, x.run_id, metrics)
                    progressed = run.last_step > x.steps_done
                    x = x.model_copy(update={"steps_done": run.last_step,
                                             "progress_at": now if progressed else x.progress_at})
                    objective = run.histories[brief.objective.metric]
                    reason = reason or (analysis.divergence(run.histories)
                                        or analysis.collapse(objective, brief.objective, brief.monitor)
                                        or analysis.plateau(objective, brief.objective, brief.monitor))
                    if steps_seen > brief.budget.max_total_steps:
                        reason = reason or "budget: trainer steps"
                if x.status == "running":
                    reason = reason or analysis.overdue(x, brief.launch.run_timeout, brief.monitor.stall_s, now)
                if x.status == "running" and reason:
                    ctx.emit("run.stopping", key=x.key, reason=reason)
                    status = "stalled" if reason.startswith(analysis.STALLED) else "stopped"
                    x = ctx.launcher.stop(x, reason, ctx.client, status)
                if x.status in TERMINAL:
                    changed = True
                    ctx.emit("run.ended", key=x.key, status=x.status, reason=x.reason)
                launches[i] = x
            if changed or not any(x.status == "running" for x in launches):
                return {"launches": dump(launches), "live": live}
            time.sleep(brief.monitor.poll_s)
