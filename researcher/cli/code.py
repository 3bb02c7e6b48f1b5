"""The `researcher study` sub-commands for proposals and code: propose, show, diff, checkout.

`propose` stores a person's proposal (a unified diff and/or config overrides) in the study's
inbox and prints its id as the last line; the study takes it up at its next plan (a `manual`
study waits for exactly this). `show` prints one proposal whole (`--json` for scripts), `diff` its
code change, `checkout` writes its code version to a folder (`--recommended DIR`: the code the study
recommends, at the commit its confirmation ran). They read the study state and
workspace and never drive the study; `cli.py` registers them next to the other sub-commands.
"""

from __future__ import annotations

import getpass
import subprocess
import time
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console
from rich.syntax import Syntax
from rich.text import Text

from researcher.brief.schema import BriefError
from researcher.lazy import lazy_module
from researcher.code.lineage import lineage, parent_problem
from researcher.evidence.study_records import StudyRecords
from researcher.records import CodeVersion, Decision, Proposal
from researcher.review.plain import plain
from researcher.review.views import proposal_view
from researcher.study import inbox
from researcher.study.snapshot import read_state as read_snapshot
from researcher.study.store import StudyError, StudyMeta, StudyPaths, load_meta, study_brief, study_paths

# LangGraph and MLflow load with the first command that reads a study's state (see researcher.cli.main).
runner = lazy_module("researcher.study.runner")
# Only `checkout --recommended` needs it, and it loads MLflow and scipy (through analysis): not at start-up.
confirmation = lazy_module("researcher.evidence.confirmation")

console = Console()
# Longest patch `propose` accepts: a study edits small sandboxes, and the diff goes into tags and prompts.
MAX_PATCH_BYTES = 1_000_000
# `show --wait` re-reads the study state this often (a validation takes tens of seconds).
_WAIT_POLL_S = 1.0


def _fail(message: str) -> typer.Exit:
    console.print(Text("error: ", style="red") + Text(plain(message)))  # data in it is never markup
    return typer.Exit(2)


def _load(ctx: typer.Context, name: str) -> tuple[StudyPaths, StudyMeta]:
    try:
        paths = study_paths(ctx.obj, name)
        return paths, load_meta(paths)
    except StudyError as e:
        raise _fail(str(e)) from None


def _overrides(pairs: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise _fail(f"--set {pair!r}: give key=value, e.g. --set trainer.lr=0.01")
        out[key.strip()] = yaml.safe_load(value)
    return out


def propose(ctx: typer.Context, name: str,
            hypothesis: str = typer.Option(..., help="What the change should show (required)."),
            patch: Optional[Path] = typer.Option(None, help="A unified diff (as `git diff` writes it), paths "
                                                           "relative to the workspace root."),
            set_: list[str] = typer.Option([], "--set", help="key=value run-config overrides."),
            parent: Optional[str] = typer.Option(None, help="Apply the patch on this code proposal's version."),
            hot_swap: bool = typer.Option(False, "--hot-swap", help="Swap the validated, approved code into the "
                                                                   "study's live run (brief `run.live: true`)."),
            by: Optional[str] = typer.Option(None, help="Who proposes; default the OS user.")) -> None:
    """Add a person's proposal to a study; prints its id last."""
    paths, meta = _load(ctx, name)
    text = None
    if patch is not None:
        if not patch.is_file():
            raise _fail(f"--patch {patch}: no such file")
        if patch.stat().st_size > MAX_PATCH_BYTES:
            raise _fail(f"--patch {patch}: larger than {MAX_PATCH_BYTES} bytes")
        text = patch.read_text()
        if not text.strip():
            raise _fail(f"--patch {patch}: the file is empty")
    if len(hypothesis.strip()) < 3:
        raise _fail("--hypothesis: say in a few words what the change should show")
    overrides = _overrides(set_)
    if text is None and not overrides:
        raise _fail("give --patch FILE, --set key=value, or both")
    try:
        brief = study_brief(paths, meta)
    except BriefError as e:
        raise _fail(str(e)) from None
    if text is not None and brief.code is None:
        raise _fail(f"study {name} edits no code: its brief has no `code:` section")
    if hot_swap and (text is None or not brief.run.live):
        raise _fail("--hot-swap needs --patch and a study with a live run (brief `run.live: true`)")
    if parent is not None:
        if text is None:
            raise _fail("--parent names the code proposal a --patch applies on; give --patch too")
        values, _, _ = read_snapshot(paths, name) or runner.read_state(paths, name)
        problem = parent_problem(parent, *state_records(values))
        if problem:
            raise _fail(f"--parent {parent}: {problem}")
    try:
        brief.resolve_config(Path(meta.workdir), overrides)
    except Exception as e:  # noqa: BLE001 - any config error is the person's to fix; nothing was stored
        raise _fail(f"--set: {e}") from None
    item = inbox.add(paths.inbox, {"hypothesis": hypothesis, "overrides": overrides, "patch": text, "parent": parent,
                                   "by": by or getpass.getuser(), "hot_swap": hot_swap})
    console.print(f"proposed to study {name}; it is validated and put up for review at the study's next plan")
    print(item.id)


def state_records(values: dict) -> tuple[list[Proposal], list[Decision], list[CodeVersion]]:
    """The proposals, decisions and code versions of a study's state (what the parent rule reads)."""
    study = StudyRecords.read(values)
    return list(study.proposals), list(study.decisions), list(study.code)


def _state(ctx: typer.Context, name: str) -> tuple[StudyPaths, StudyMeta, dict]:
    paths, meta = _load(ctx, name)
    # Straight from the checkpoint where it can, as `status` does: the study runtime (LangGraph, MLflow)
    # costs ~5 s of CPU a command, and `show --wait` reads the state every poll.
    values, _, _ = read_snapshot(paths, name) or runner.read_state(paths, name)
    return paths, meta, values


def show(ctx: typer.Context, name: str, proposal_id: str = typer.Argument(..., metavar="ID"),
         as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
         wait: float = typer.Option(0.0, help="Wait up to this many seconds for the proposal to be taken up and "
                                              "validated.")) -> None:
    """Print one proposal whole: status, validation, commit, runs, score."""
    _, _, values = _state(ctx, name)
    view = proposal_view(values, proposal_id)
    deadline = time.monotonic() + wait
    while (view is None or view.status == "validating") and time.monotonic() < deadline:
        time.sleep(_WAIT_POLL_S)
        _, _, values = _state(ctx, name)
        view = proposal_view(values, proposal_id)
    if view is None:
        raise _fail(f"study {name} has no proposal {proposal_id} (yet: a proposal joins at the study's next plan)")
    if as_json:
        print(view.model_dump_json(indent=1))
        return
    say = _say
    say(Text.assemble((view.id, "bold"), f" ({view.kind}, {plain(view.planner)}): ", (view.status, "bold")))
    say(f"hypothesis: {plain(view.hypothesis)}")
    if view.overrides:
        say(f"overrides: {plain(view.overrides)}")
    if view.kind == "code":
        say(f"validation: {'passed' if view.validation.passed else 'FAILED at ' + str(view.validation.step)}"
            if view.validation.passed is not None else "validation: running")
        say(plain(view.validation.log))
        say(f"commit: {view.commit or '-'}" + (f" (on {view.parent})" if view.parent else ""))
        if view.chain:
            say("chain: " + " -> ".join(["base", *view.chain, view.id]) + " (approving it approves all of this "
                f"code: `researcher study diff {name} {view.id}` prints the whole change against the base)")
    if view.decision:
        d = view.decision
        say(f"decision: {d['verdict']} by {plain(d['by'])} at {plain(d['at'])}" + (f": {plain(d['reason'])}" if d["reason"] else ""))
    for r in view.runs:
        say(f"run {r.key}: {r.status} (MLflow {r.mlflow_run_id or '-'})")
    if view.score is not None:
        say(f"score: {view.score:.4g}")
    if view.swap:
        say(f"swap: {plain(view.swap)}")
    if view.result:
        say(f"result: {plain(view.result)}")


def _say(line: str | Text) -> None:
    """One line of `show`: plain text, never rich markup, with control characters escaped (review/plain.py)."""
    console.print(line if isinstance(line, Text) else Text(plain(line)), markup=False, highlight=False,
                  soft_wrap=True)


def print_diff(text: str) -> None:
    """A diff with syntax highlighting on a terminal, plain when piped; either way its control characters are
    escaped (`\\x1b`), so a comment in it cannot drive the reviewer's terminal. The exact bytes are the
    study's `diffs/<id>.diff` and `checkout`'s."""
    shown = plain(text)
    if console.is_terminal:
        console.print(Syntax(shown, "diff", theme="ansi_dark", word_wrap=True))
    else:
        print(shown, end="" if shown.endswith("\n") else "\n")


def diff(ctx: typer.Context, name: str, proposal_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Print a proposal's code diff."""
    paths, _, values = _state(ctx, name)
    if proposal_view(values, proposal_id) is None:
        raise _fail(f"study {name} has no proposal {proposal_id}")
    text = reviewed_diff(paths, values, proposal_id)
    if text is None:
        raise _fail(f"proposal {proposal_id} has no code diff (a config proposal, or still validating)")
    if not text:
        raise _fail(f"proposal {proposal_id}'s change did not apply, so it has no diff; see "
                    f"`researcher study show {name} {proposal_id}`")
    print_diff(text)


def reviewed_diff(paths: StudyPaths, values: dict, proposal_id: str) -> str | None:
    """What `diff` and `review` print of a code proposal: its diff, or for one on a parent its chain and its
    whole change against the base commit first (`code.lineage`); None without a code version."""
    proposals, _, code = state_records(values)
    version = next((v for v in code if v.proposal_id == proposal_id), None)
    if version is None:
        return None
    chained = lineage(proposal_id, proposals, version, paths.workspace, values.get("workspace_base", ""))
    return chained.review_diff(proposal_id, version.diff) if version.diff else ""


def checkout(ctx: typer.Context, name: str,
             proposal_id: Optional[str] = typer.Argument(None, metavar="[ID]"),
             folder: Optional[Path] = typer.Argument(None, metavar="[DIR]", help="An empty or new folder."),
             recommended: Optional[Path] = typer.Option(None, "--recommended", metavar="DIR",
                                                        help="Write the study's recommended code to DIR instead.")) -> None:
    """Write a proposal's code version (its commit; a config proposal's: the base) to DIR."""
    paths, meta, values = _state(ctx, name)
    brief = study_brief(paths, meta)
    if brief.code is None or not values.get("workspace_base"):
        raise _fail(f"study {name} has no code workspace")
    if recommended is not None:
        if proposal_id is not None or folder is not None:
            raise _fail("give either ID DIR or --recommended DIR, not both")
        steps = brief.resolve_config(Path(meta.workdir)).trainer.steps
        study = StudyRecords.read(values)
        found = confirmation.recommended(study.proposals, study.results, steps, brief)
        if found is None:
            raise _fail(f"study {name} recommends nothing (yet): nothing was judged better and confirmed")
        pick, commit = found
        _write(paths, commit or values["workspace_base"], recommended, f"recommended {pick.id}")
        return
    if proposal_id is None or folder is None:
        raise _fail("give ID DIR (a proposal's code) or --recommended DIR (the study's recommendation)")
    view = proposal_view(values, proposal_id)
    if view is None:
        raise _fail(f"study {name} has no proposal {proposal_id}")
    if view.kind == "code" and not view.commit:
        raise _fail(f"proposal {proposal_id} has no code version ({view.status})")
    _write(paths, view.commit or values["workspace_base"], folder, proposal_id)


def _write(paths: StudyPaths, commit: str, folder: Path, what: str) -> None:
    if folder.exists() and any(folder.iterdir()):
        raise _fail(f"{folder} is not empty")
    try:  # the archive streams straight into tar: no worktree is left registered in the workspace
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(paths.workspace), "archive", "--format=tar", commit],
                                 capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError) as e:
        raise _fail(f"could not write {commit[:12]} to {folder}: {e}") from None
    console.print(f"{what} ({commit}) written to {folder}")
