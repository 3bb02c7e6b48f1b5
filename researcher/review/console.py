"""Rich rendering for the `researcher` command: live study events, and the tables of its reports.

`StudyConsole` turns the study's events into lines and a spinner while it waits on runs or a
person. The table builders render proposals, decisions and budgets. Nothing here changes a study.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.status import Status
from rich.table import Table
from rich.text import Text

from researcher.brief.schema import Brief
from researcher.budget import Spent
from researcher.records import ExperimentResult, IgnoredChange
from researcher.review.plain import cell, plain


def _e(value: object) -> str:
    """An untrusted value inside a rich markup string: one plain line, its `[` escaped (review/plain.py)."""
    return escape(cell(value))


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
            c.print(f"[bold]{'Starting' if event == 'study.start' else 'Resuming'} study {_e(info['study'])}[/bold]")
        elif event == "plan":
            c.print(f"[cyan]plan round {_e(info['round'])}[/cyan] ({_e(info['planner'])}, {info['plan_s']:.2f} s): "
                    f"{_e(info['proposals'])} proposal(s). {_e(info['note'])}")
        elif event == "decision":
            c.print(f"  {_e(info['proposal_id'])}: [{'green' if info['verdict'] == 'approved' else 'red'}]"
                    f"{_e(info['verdict'])}[/] by {_e(info['by'])}" + (f" ({_e(info['reason'])})" if info["reason"] else ""))
        elif event == "review.ignored":
            c.print(f"  [yellow]{_e(info['proposal_id'])}: its tags were changed to {_e(repr(info['changed_to']))} by {_e(info['by'])} "
                    f"after it was {_e(info['decided'])}: ignored (a decision is final)[/yellow]")
        elif event == "review.waiting":
            ids = ", ".join(info["ids"])
            c.print(f"[yellow]waiting for review[/yellow] of {ids}: `researcher study approve {self.name} "
                    f"IDS` / `veto`, or set the MLflow tag review.status (checked every {info['poll_s']:g} s)")
            self._spin(f"[{self.name}] waiting for review of {ids}")
        elif event == "launch.spawned":
            self._started += 1
            c.print(f"  launched {_e(info['key'])} (pid {_e(info['pid'])})")
        elif event == "run.stopping":
            c.print(f"  [yellow]stopping {_e(info['key'])}[/yellow]: {_e(info['reason'])}")
        elif event == "run.ended":
            self._ended += 1
            colour = "green" if info["status"] == "finished" else "red"
            c.print(f"  run {_e(info['key'])} [{colour}]{_e(info['status'])}[/]" + (f": {_e(info['reason'])}" if info["reason"] else ""))
            self._spin(f"[{self.name}] watching core runs: {self._ended} ended of {self._started} started")
        elif event == "validation.step":
            self._spin(f"[{self.name}] validating {_e(info['proposal_id'])}: {_e(info['step'])}")
        elif event == "validation":
            c.print(f"  {_e(info['proposal_id'])}: " + (f"[green]valid[/green], commit {_e(info['commit'][:12])}" if info["passed"]
                                                    else f"[red]invalid[/red] at step {_e(info['step'])}"))
        elif event == "plan.waiting":
            c.print(f"[yellow]waiting for proposals[/yellow]: `researcher study propose {self.name} ...` "
                    f"(checked every {info['poll_s']:g} s)")
            self._spin(f"[{self.name}] waiting for people's proposals")
        elif event == "result":
            c.print(f"  result {_e(info['proposal_id'])}: {_e(info['status'])}, score {_e(info['summary'])}")
        elif event == "report":
            c.print(f"report written: [bold]{_e(info['path'])}[/bold]")
        elif event == "study.failed":
            c.print(f"[bold red]study {_e(info['study'])} failed[/bold red]: {_e(info['reason'])}")
        elif event == "study.done":
            c.print(f"[bold green]study {_e(info['study'])} finished[/bold green]: {_e(info['stop_reason'])}")


def _add(table: Table, *cells: object) -> None:
    """A table row of plain text cells: control characters escaped, no markup read (review/plain.py)."""
    table.add_row(*(Text(plain(c)) for c in cells))


def proposals_table(title: str, rows: list[dict[str, str]]) -> Table:
    table = Table(title=title)
    for col in ("id", "status", "hypothesis", "diff", "decided by", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        why = Text(plain(r.get("reason", "")))
        if r.get("error"):
            why.append(" " + plain(r["error"]), style="red")
        table.add_row(*(Text(plain(r.get(k, ""))) for k in ("id", "status", "hypothesis", "diff", "by")), why)
    return table


def budget_table(spent: Spent, brief: Brief) -> Table:
    table = Table(title="budget")
    for col in ("budget", "used", "limit"):
        table.add_column(col)
    for row in spent.rows(brief):
        _add(table, *row)
    return table


def verdicts_table(results: list[dict[str, Any]]) -> Table:
    """Each judged experiment against its baseline: result, effect with its CI, p, and the test that decided."""
    table = Table(title="verdicts against the baseline")
    for col in ("proposal", "verdict (effect, 95% CI, p, test)", "confirmation"):
        table.add_column(col, overflow="fold")
    for raw in results:
        r = ExperimentResult.model_validate(raw)
        verdict = r.verdict.fmt() if r.verdict else ("baseline (the reference)" if r.status == "ok" else r.status)
        _add(table, r.proposal_id, verdict, r.confirmation.fmt() if r.confirmation else "")
    return table


def _source(d: dict[str, Any]) -> str:
    """Where a decision came from; for MLflow, whether the server authenticated its writer."""
    if d["source"] != "mlflow":
        return d["source"]
    return "mlflow (basic-auth account)" if d.get("authenticated") else "mlflow (unauthenticated: anyone who reached it)"


def decisions_table(decisions: list[dict[str, Any]], recorded_only: list[dict[str, str]],
                    ignored: list[IgnoredChange] | None = None) -> Table:
    table = Table(title="decisions")
    for col in ("proposal", "verdict", "by", "when", "source", "why"):
        table.add_column(col, overflow="fold")
    for d in decisions:
        when = d["at"] + (" (seen at poll time)" if d.get("at_poll_time") else "")
        _add(table, d["proposal_id"], d["verdict"], d["by"], when, _source(d), d["reason"])
    for r in recorded_only:
        _add(table, r["id"], r["status"], r["by"] or "mlflow-ui", r["at"], "mlflow (not yet taken up)", r["reason"])
    for c in ignored or []:
        _add(table, c.proposal_id, f"{c.changed_to} (ignored)", c.by, c.at + (" (seen at poll time)" if c.at_poll_time else ""),
                      "mlflow (after the decision)", f"changed after it was {c.decided}: a decision is final")
    return table
