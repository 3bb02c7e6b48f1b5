"""Rich rendering for the `researcher` command: live study events, and the tables of its reports.

`StudyConsole` turns the study's events into lines and a spinner while it waits on runs or a
person. The table builders render proposals, decisions and budgets. Nothing here changes a study.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.status import Status
from rich.table import Table

from researcher.brief.schema import Brief
from researcher.budget import Spent
from researcher.records import ExperimentResult, IgnoredChange


class StudyConsole:
    """An `emit` callback for `run_study` that prints progress with rich."""

    def __init__(self, console: Console, name: str) -> None:
        self.console, self.name = console, name
        self._status: Status | None = None
        self._started = self._ended = 0

    def _spin(self, text: str | None) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        if text and self.console.is_terminal:
            self._status = self.console.status(text)
            self._status.start()

    def close(self) -> None:
        self._spin(None)

    def __call__(self, event: str, **info: Any) -> None:
        c = self.console
        if event == "node":
            if info["node"] == "monitor":
                self._spin(f"[{self.name}] watching core runs: {self._ended} ended of {self._started} started")
            return
        self._spin(None)
        if event in ("study.start", "study.resume"):
            c.print(f"[bold]{'Starting' if event == 'study.start' else 'Resuming'} study {info['study']}[/bold]")
        elif event == "plan":
            c.print(f"[cyan]plan round {info['round']}[/cyan] ({info['planner']}, {info['plan_s']:.2f} s): "
                    f"{info['proposals']} proposal(s). {info['note']}")
        elif event == "decision":
            c.print(f"  {info['proposal_id']}: [{'green' if info['verdict'] == 'approved' else 'red'}]"
                    f"{info['verdict']}[/] by {info['by']}" + (f" ({info['reason']})" if info["reason"] else ""))
        elif event == "review.ignored":
            c.print(f"  [yellow]{info['proposal_id']}: its tags were changed to {info['changed_to']!r} by {info['by']} "
                    f"after it was {info['decided']}: ignored (a decision is final)[/yellow]")
        elif event == "review.waiting":
            ids = ", ".join(info["ids"])
            c.print(f"[yellow]waiting for review[/yellow] of {ids}: `researcher study approve {self.name} "
                    f"IDS` / `veto`, or set the MLflow tag review.status (checked every {info['poll_s']:g} s)")
            self._spin(f"[{self.name}] waiting for review of {ids}")
        elif event == "launch.spawned":
            self._started += 1
            c.print(f"  launched {info['key']} (pid {info['pid']})")
        elif event == "run.stopping":
            c.print(f"  [yellow]stopping {info['key']}[/yellow]: {info['reason']}")
        elif event == "run.ended":
            self._ended += 1
            colour = "green" if info["status"] == "finished" else "red"
            c.print(f"  run {info['key']} [{colour}]{info['status']}[/]" + (f": {info['reason']}" if info["reason"] else ""))
            self._spin(f"[{self.name}] watching core runs: {self._ended} ended of {self._started} started")
        elif event == "validation.step":
            self._spin(f"[{self.name}] validating {info['proposal_id']}: {info['step']}")
        elif event == "validation":
            c.print(f"  {info['proposal_id']}: " + (f"[green]valid[/green], commit {info['commit'][:12]}" if info["passed"]
                                                    else f"[red]invalid[/red] at step {info['step']}"))
        elif event == "plan.waiting":
            c.print(f"[yellow]waiting for proposals[/yellow]: `researcher study propose {self.name} ...` "
                    f"(checked every {info['poll_s']:g} s)")
            self._spin(f"[{self.name}] waiting for people's proposals")
        elif event == "result":
            c.print(f"  result {info['proposal_id']}: {info['status']}, score {info['summary']}")
        elif event == "report":
            c.print(f"report written: [bold]{info['path']}[/bold]")
        elif event == "study.done":
            c.print(f"[bold green]study {info['study']} finished[/bold green]: {info['stop_reason']}")


def proposals_table(title: str, rows: list[dict[str, str]]) -> Table:
    table = Table(title=title)
    for col in ("id", "status", "hypothesis", "diff", "decided by", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["id"], r["status"], r["hypothesis"], r["diff"], r.get("by", ""), r.get("reason", "")
                      + (f" [red]{r['error']}[/red]" if r.get("error") else ""))
    return table


def budget_table(spent: Spent, brief: Brief) -> Table:
    table = Table(title="budget")
    for col in ("budget", "used", "limit"):
        table.add_column(col)
    for row in spent.rows(brief):
        table.add_row(*row)
    return table


def verdicts_table(results: list[dict[str, Any]]) -> Table:
    """Each judged experiment against its baseline: result, effect with its CI, p, and the test that decided."""
    table = Table(title="verdicts against the baseline")
    for col in ("proposal", "verdict (effect, 95% CI, p, test)", "confirmation"):
        table.add_column(col, overflow="fold")
    for raw in results:
        r = ExperimentResult.model_validate(raw)
        verdict = r.verdict.fmt() if r.verdict else ("baseline (the reference)" if r.status == "ok" else r.status)
        table.add_row(r.proposal_id, verdict, r.confirmation.fmt() if r.confirmation else "")
    return table


def decisions_table(decisions: list[dict[str, Any]], recorded_only: list[dict[str, str]],
                    ignored: list[IgnoredChange] | None = None) -> Table:
    table = Table(title="decisions")
    for col in ("proposal", "verdict", "by", "when", "source", "why"):
        table.add_column(col, overflow="fold")
    for d in decisions:
        when = d["at"] + (" (seen at poll time)" if d.get("at_poll_time") else "")
        table.add_row(d["proposal_id"], d["verdict"], d["by"], when, d["source"], d["reason"])
    for r in recorded_only:
        table.add_row(r["id"], r["status"], r["by"] or "mlflow-ui", r["at"], "mlflow (not yet taken up)", r["reason"])
    for c in ignored or []:
        table.add_row(c.proposal_id, f"{c.changed_to} (ignored)", c.by, c.at + (" (seen at poll time)" if c.at_poll_time else ""),
                      "mlflow (after the decision)", f"changed after it was {c.decided}: a decision is final")
    return table
