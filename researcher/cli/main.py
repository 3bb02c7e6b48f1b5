"""The `researcher` command: start, watch, review, resume, stop and report on studies.

Every `researcher study` sub-command of DESIGN §4.3. Commands that change a study (approve, veto)
write to the review surface in MLflow; a study process that is running picks the decision up by
polling, and one that is not running is resumed in the background. The command renders with rich
and turns every known error into one clear line and exit code 2.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import getpass
import json
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

from core.config_io import ConfigError, flatten
from researcher.brief.schema import BriefError
from researcher.budget import Spent
from researcher.cli.code import checkout, diff, print_diff, propose, reviewed_diff, show, state_records
from researcher.lazy import lazy_module
from researcher.planner.types import PlannerError, choose_planner
from researcher.code.lineage import parent_problem
from researcher.evidence.study_records import StudyRecords
from researcher.records import Decision
from researcher.review.console import StudyConsole, budget_table, decisions_table, proposals_table, verdicts_table
from researcher.review.plain import plain, plain_record
from researcher.review.views import best_result, status_json, view_of
from researcher.study.snapshot import read_state as read_snapshot
from researcher.study.store import (
    StudyError,
    StudyMeta,
    StudyPaths,
    failure,
    resume_in_background,
    list_studies,
    load_meta,
    owner_pid,
    stop_background,
    study_brief,
    study_paths,
)

# How long `stop` waits for the study process to release its lock after SIGTERM.
_STOP_WAIT_S = 30.0
# A study process holds LangGraph, MLflow and scipy: Python's final garbage collection over them costs
# ~1.5 s of CPU at every exit, after the work is done; freezing the heap skips it (as `swarm` does).
atexit.register(gc.freeze)

app = typer.Typer(help="Automated research studies around swarmrl core runs.", no_args_is_help=True)
study_app = typer.Typer(help="Start and manage studies.", no_args_is_help=True)
app.add_typer(study_app, name="study")
console = Console()
# The study runtime (LangGraph, MLflow) loads with the first command that uses it, so `--help`
# answers without it (bench/startup.py). Errors that print as one line and exit 2 are looked up
# when one is raised: `except` evaluates its tuple only then, and reviews.ReviewError needs MLflow.
runner = lazy_module("researcher.study.runner")
reports = lazy_module("researcher.review.report")
backends = lazy_module("researcher.runs.backends")
reviews = lazy_module("researcher.review.mlflow_review")


def _known_errors() -> tuple[type[Exception], ...]:
    return (BriefError, StudyError, reviews.ReviewError, PlannerError, ConfigError)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log INFO messages too.")) -> None:
    handler = RichHandler(console=Console(stderr=True), show_path=False)
    handler.addFilter(plain_record)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s", handlers=[handler])


@study_app.callback()
def _study(ctx: typer.Context, studies_dir: Path = typer.Option(
        Path("studies"), envvar="RESEARCHER_STUDIES_DIR", help="Folder that holds the studies.")) -> None:
    ctx.obj = studies_dir.resolve()


def _fail(message: str) -> typer.Exit:
    console.print(Text("error: ", style="red") + Text(plain(message)))  # data in it is never markup
    return typer.Exit(2)


def _paths(ctx: typer.Context, name: str) -> StudyPaths:
    return study_paths(ctx.obj, name)


def _sigterm_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _drive(paths: StudyPaths, wait: bool) -> None:
    """Run the study in this process with live output."""
    name = paths.root.name
    printer = StudyConsole(console, name)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        outcome = runner.run_study(paths, printer, wait_for_review=wait)
    except KeyboardInterrupt:
        printer.close()
        console.print(f"[yellow]study {name} paused[/yellow]; its core runs keep going. "
                      f"Continue with `researcher study resume {name}`.")
        return
    except _known_errors() as e:
        printer.close()
        raise _fail(f"{e}\nThe study is saved; fix the cause and run `researcher study resume {name}`.") from None
    printer.close()
    if outcome.done:
        console.print(f"study {name} is done. Report: [bold]{outcome.report}[/bold]")
    else:
        console.print(f"study {name} waits for review of {', '.join(outcome.waiting)}; approve or veto, and it "
                      "resumes.")



@study_app.command()
def start(ctx: typer.Context, brief: Path = typer.Argument(..., help="The research brief (Markdown)."),
          name: Optional[str] = typer.Option(None, help="Study name; default: the brief's file name."),
          detach: bool = typer.Option(False, help="Run in the background (pid file and log in the study)."),
          planner: Optional[str] = typer.Option(None, help="llm, heuristic or manual (only people's proposals); "
                                                           "default llm when an endpoint is set."),
          llm_base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible base URL (or OPENAI_BASE_URL)."),
          llm_model: Optional[str] = typer.Option(None, help="Model name for the llm planner (or OPENAI_MODEL)."),
          wait: bool = typer.Option(True, help="Wait for reviews; --no-wait returns when a review is needed.")) -> None:
    """Start a study from a brief."""
    try:
        study = name or brief.stem
        spec = choose_planner(planner, llm_base_url, llm_model)
        paths, meta, parsed = runner.new_study(ctx.obj, brief, study, spec, Path.cwd(), os.environ.get("MLFLOW_TRACKING_URI"))
    except _known_errors() as e:
        raise _fail(str(e)) from None
    console.print(f"study [bold]{study}[/bold]: {parsed.title or brief.name}; planner {spec.kind}"
                  + (" (offline default: no LLM configured)" if spec.kind == "heuristic" and planner is None else "")
                  + f"; MLflow experiment {meta.experiment} at {meta.tracking_uri}")
    if detach:
        pid = resume_in_background(paths)
        console.print(f"running in the background, pid {pid}; log {paths.log}")
        return
    _drive(paths, wait)


def _unfinished(studies_dir: Path) -> list[str]:
    """Studies that are not done, not running, and not held by a person's `stop`."""
    out = []
    for n in list_studies(studies_dir):
        paths = study_paths(studies_dir, n)
        values, nxt, _ = runner.read_state(paths, n)
        if (values and not nxt) or owner_pid(paths) or paths.held.exists():
            continue
        out.append(n)
    return out


@study_app.command()
def resume(ctx: typer.Context, name: Optional[str] = typer.Argument(None, help="The study; or --all."),
           every: bool = typer.Option(False, "--all", help="Resume every unfinished study in the background "
                                                           "(after a reboot: see README)."),
           detach: bool = typer.Option(False, help="Run in the background."),
           wait: bool = typer.Option(True, help="Wait for reviews; --no-wait returns when a review is needed.")) -> None:
    """Continue a study from its last checkpoint (after a crash, a stop, a reboot or a review)."""
    if every == (name is not None):
        raise _fail("give a study name or --all, not both")
    if every:
        names = _unfinished(ctx.obj)
        for n in names:
            console.print(f"resuming {n} in the background, pid {resume_in_background(study_paths(ctx.obj, n))}")
        if not names:
            console.print(f"no unfinished study to resume in {ctx.obj}")
        return
    assert name is not None  # checked above
    try:
        paths = _paths(ctx, name)
        load_meta(paths)
    except _known_errors() as e:
        raise _fail(str(e)) from None
    paths.held.unlink(missing_ok=True)  # a person resuming it lifts their own stop
    if detach:
        console.print(f"resuming in the background, pid {resume_in_background(paths)}; log {paths.log}")
        return
    _drive(paths, wait)


@study_app.command("list")
def list_(ctx: typer.Context) -> None:
    """List the studies in the studies folder."""
    names = list_studies(ctx.obj)
    if not names:
        console.print(f"no studies in {ctx.obj}")
    for n in names:
        paths = study_paths(ctx.obj, n)
        values, nxt, waiting = runner.read_state(paths, n)
        pid = owner_pid(paths)
        line = f"{n}: {_phase(paths, values, nxt, waiting, pid)}" + (f" (running, pid {pid})" if pid else "")
        console.print(Text(plain(line + f", round {values.get('round', 0)}")), highlight=False)


def _phase(paths: StudyPaths, values: dict, nxt: tuple[str, ...], waiting: list[str], pid: int | None) -> str:
    """One word or line for where a study is: done, failed (with why: a study that cannot go on is never
    shown at the node it failed in), waiting for review, or its next node."""
    failed = failure(paths)
    if failed and not pid:
        return failed
    return "done" if values and not nxt else ("review: waiting for decisions" if waiting else (nxt[0] if nxt else "new"))


def _load(ctx: typer.Context, name: str) -> tuple[StudyPaths, StudyMeta]:
    try:
        paths = _paths(ctx, name)
        return paths, load_meta(paths)
    except _known_errors() as e:
        raise _fail(str(e)) from None


@study_app.command()
def status(ctx: typer.Context, name: str,
           as_json: bool = typer.Option(False, "--json", help="Machine-readable: every proposal with its verdict.")) -> None:
    """Phase, budget used, pending reviews and the best result so far."""
    paths, meta = _load(ctx, name)
    # Without the study runtime where it can (bench/startup.py): the state straight from the checkpoint, MLflow only when a review may be pending.
    brief = study_brief(paths, meta)
    values, nxt, waiting = read_snapshot(paths, name) or runner.read_state(paths, name)
    pid = owner_pid(paths)
    phase = _phase(paths, values, nxt, waiting, pid)
    if as_json:
        print(json.dumps(status_json(name, values, phase, pid, brief), indent=1))
        return
    console.print(Text.assemble("study ", (name, "bold"), plain(f" ({meta.planner.kind} planner): phase {phase}, round "
                                                               f"{values.get('round', 0)}; ")
                                + (f"running (pid {pid})" if pid else "not running")), highlight=False)
    if values.get("stop_reason"):
        console.print(Text(plain(f"stopped: {values['stop_reason']}")), highlight=False)
    console.print(budget_table(Spent.of(values, gpus=brief.launch.gpus), brief))
    # A proposal decided in the state is decided on the board too (a decision is final), and one that
    # failed validation is published as invalid: the board can hold a pending review only when the
    # state has a proposal that is neither.
    study = StudyRecords.read(values)
    if any(view_of(study, p.id).status == "pending" for p in study.proposals):  # type: ignore[union-attr]
        pending = [r for r in runner.open_board(meta).board() if r["status"] == "pending"]
        if pending:
            console.print(proposals_table("pending reviews", pending))
    best = best_result(study, brief)
    if best:
        console.print(Text(plain(f"best so far: {best[0].id} {best[0].overrides}: {brief.objective.metric} "
                                 f"{best[1].summary.fmt()}")), highlight=False)  # type: ignore[union-attr]


@study_app.command()
def review(ctx: typer.Context, name: str, all_: bool = typer.Option(False, "--all", help="Show decided ones too.")) -> None:
    """Show the proposals awaiting review (hypothesis, rationale, config diff)."""
    _, meta = _load(ctx, name)
    rows = [r for r in runner.open_board(meta).board() if all_ or r["status"] not in ("approved", "vetoed", "invalid")]
    console.print(proposals_table(f"proposals of {name}", rows) if rows else "nothing awaits review")
    paths = _paths(ctx, name)
    values, _, _ = runner.read_state(paths, name)
    code = StudyRecords.read(values).versions
    for r in rows:
        version = code.get(r["id"])
        if version is None:
            continue
        console.print(Text.assemble((plain(r["id"]), "bold"), f" {version.checks()}"))
        if version.diff:
            console.print(Text.assemble((plain(r["id"]), "bold"), f" code diff (commit {version.commit[:12] or '-'}):"))
            print_diff(reviewed_diff(paths, values, r["id"]) or version.diff)
    console.print(f"MLflow: experiment {meta.experiment} at {meta.tracking_uri}")


def _decide(ctx: typer.Context, name: str, ids: list[str], every: bool, verdict: str, reason: str,
            by: Optional[str], resume_: bool) -> None:
    paths, meta = _load(ctx, name)
    board = runner.open_board(meta)
    if every:
        ids = [r["id"] for r in board.board() if r["status"] == "pending"]
    if not ids:
        raise _fail("name the proposals to decide (or --all for every pending one)")
    who = by or getpass.getuser()
    if verdict == "approved":  # a proposal on a parent that is not approved and executed is never approved
        values, _, _ = read_snapshot(paths, name) or runner.read_state(paths, name)
        proposals, decisions, code = state_records(values)
        for pid in ids:
            p = next((x for x in proposals if x.id == pid), None)
            problem = parent_problem(p.parent, proposals, decisions, code) if p and p.kind == "code" and p.parent else None
            if problem:
                raise _fail(f"{pid} cannot be approved: {problem}")
    try:
        for pid in ids:
            board.decide(Decision(proposal_id=pid, verdict=verdict, by=who, reason=reason, source="cli"))  # type: ignore[arg-type]
            console.print(f"{pid}: {verdict} by {who}" + (f" ({reason})" if reason else ""))
    except _known_errors() as e:
        raise _fail(str(e)) from None
    owner = owner_pid(paths)
    if owner:
        console.print(f"study {name} is running (pid {owner}) and takes the decision up at its next check")
    elif resume_:
        console.print(f"study {name} was not running: resumed in the background, pid {resume_in_background(paths)}; log {paths.log}")


@study_app.command()
def approve(ctx: typer.Context, name: str, ids: list[str] = typer.Argument(None, help="Proposal ids."),
            all_: bool = typer.Option(False, "--all", help="Approve every pending proposal."),
            reason: str = typer.Option("", help="Why."), by: Optional[str] = typer.Option(None, help="Reviewer; default the OS user."),
            resume_: bool = typer.Option(True, "--resume/--no-resume", help="Resume a study that is not running.")) -> None:
    """Approve proposals."""
    _decide(ctx, name, ids or [], all_, "approved", reason, by, resume_)


@study_app.command()
def veto(ctx: typer.Context, name: str, ids: list[str] = typer.Argument(..., help="Proposal ids."),
         reason: str = typer.Option(..., help="Why (required: it feeds the next plan)."),
         by: Optional[str] = typer.Option(None, help="Reviewer; default the OS user."),
         resume_: bool = typer.Option(True, "--resume/--no-resume", help="Resume a study that is not running.")) -> None:
    """Veto proposals; a veto is final and feeds back into the next plan."""
    if not reason.strip():
        raise _fail("a veto needs a --reason")
    _decide(ctx, name, ids, False, "vetoed", reason, by, resume_)


@study_app.command()
def stop(ctx: typer.Context, name: str,
         kill_runs: bool = typer.Option(False, help="Also stop its running core runs (else they finish and are "
                                                    "picked up on resume).")) -> None:
    """Stop the study's process; `resume` continues it from its last checkpoint."""
    paths, meta = _load(ctx, name)
    paths.held.write_text(f"stopped by {getpass.getuser()} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    pid = owner_pid(paths)
    stop_background(paths)  # a background resume still starting would take the study over after this stop
    if pid and pid > 0:
        with contextlib.suppress(ProcessLookupError):  # it may be one of those, already signalled
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_WAIT_S
        while owner_pid(paths) and time.monotonic() < deadline:
            time.sleep(0.2)
        console.print(f"study {name} stopped (pid {pid})" if not owner_pid(paths) else
                      f"[red]study {name} (pid {pid}) did not stop within {_STOP_WAIT_S:.0f} s[/red]")
    else:
        console.print(f"study {name} is not running")
    if kill_runs:
        brief = study_brief(paths, meta)
        keys = backends.stop_all(paths.state, f"stopped by {getpass.getuser()} (researcher study stop)", brief.launch.grace_s)
        console.print(f"stopped core runs: {', '.join(keys) or 'none were running'}")


@study_app.command()
def report(ctx: typer.Context, name: str) -> None:
    """Write the Markdown report of the study so far."""
    paths, meta = _load(ctx, name)
    brief = study_brief(paths, meta)
    values, _, _ = runner.read_state(paths, name)
    base = flatten(brief.resolve_config(Path(meta.workdir)))
    from mlflow.tracking import MlflowClient

    board = runner.open_board(meta)
    board.audit(list(StudyRecords.read(values).decisions))
    path = reports.write_report(name, brief, values, MlflowClient(meta.tracking_uri), paths, base, board.ignored(),
                                failed=failure(paths))
    console.print(f"report written: [bold]{path}[/bold]")


@study_app.command()
def history(ctx: typer.Context, name: str) -> None:
    """Every decision: who, when, what and why; later edits of decided tags (ignored); each verdict and its test."""
    paths, meta = _load(ctx, name)
    values, _, _ = runner.read_state(paths, name)
    decisions = values.get("decisions", [])
    taken = {d["proposal_id"] for d in decisions}
    board = runner.open_board(meta)
    board.audit(list(StudyRecords.read(values).decisions))  # edits no running study has seen yet
    recorded = [r for r in board.board() if r["status"] in ("approved", "vetoed") and r["id"] not in taken]
    console.print(decisions_table(decisions, recorded, board.ignored()))
    if values.get("results"):
        console.print(verdicts_table(values["results"]))


study_app.command()(propose)
study_app.command()(show)
study_app.command()(diff)
study_app.command()(checkout)


if __name__ == "__main__":
    app()
