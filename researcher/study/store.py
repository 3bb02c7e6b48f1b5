"""Where a study lives on disk, what it was started with, and which process owns it.

`studies/<name>/` holds the report; `studies/<name>/.study/` holds the frozen copy of the brief,
`study.json` (planner, tracking URI, folder: everything a resume needs, and no secrets), the
LangGraph checkpoint database, run logs and launch intents, and the owner's lock and pid file.
The lock is an `flock` held for the owner's lifetime, so it vanishes with a killed process and
two processes can never drive one study. This module names and guards files; it runs nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from pydantic import BaseModel

from researcher.brief.loader import load_brief
from researcher.brief.schema import Brief
from researcher.planner.types import PlannerSpec
from researcher.records import now_iso

# Study names become folder names, MLflow experiment names and filter values: keep them plain.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow's own default, as the core uses it


class StudyError(RuntimeError):
    """A study command that cannot proceed; the message says why and what to do."""


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise StudyError(f"study name {name!r} must be 1-64 letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit")
    return name


def experiment_name(study: str) -> str:
    return f"study-{study}"


def resolve_tracking_uri(uri: str | None, workdir: Path) -> str:
    """An absolute form of the tracking URI, so core runs and later commands find the same store."""
    uri = uri or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str((workdir / uri.removeprefix("sqlite:///")).resolve())
    if "://" not in uri:
        return str((workdir / uri).resolve())
    return uri


def default_swarm_command() -> list[str]:
    """`swarm run` from the same environment as this Python, else from PATH."""
    local = Path(sys.executable).parent / "swarm"
    return [str(local) if local.exists() else (shutil.which("swarm") or "swarm"), "run"]


class StudyMeta(BaseModel):
    name: str
    brief_source: str  # the brief as given to `start`; the study uses its frozen copy
    workdir: str  # folder the study started in; relative paths of the brief resolve here
    tracking_uri: str
    experiment: str
    planner: PlannerSpec
    created_at: str


def study_brief(paths: StudyPaths, meta: StudyMeta) -> Brief:
    """The study's brief, its relative paths resolved from the folder the study started in."""
    return load_brief(paths.brief, Path(meta.workdir))


@dataclass(frozen=True)
class StudyPaths:
    root: Path

    @property
    def state(self) -> Path:
        return self.root / ".study"

    @property
    def db(self) -> Path:
        return self.state / "state.db"

    @property
    def meta(self) -> Path:
        return self.state / "study.json"

    @property
    def brief(self) -> Path:
        return self.state / "brief.md"

    @property
    def configs(self) -> Path:
        return self.state / "configs"

    @property
    def log(self) -> Path:
        return self.state / "study.log"

    @property
    def pid(self) -> Path:
        return self.state / "study.pid"

    @property
    def lock(self) -> Path:
        return self.state / "lock"

    @property
    def held(self) -> Path:
        """Present while a person's `stop` holds the study: `resume --all` leaves it alone."""
        return self.state / "held"

    @property
    def failed(self) -> Path:
        """Present while the study has failed: a node raised, so it cannot go on (`mark_failed`)."""
        return self.state / "failed.json"

    @property
    def inbox(self) -> Path:
        return self.state / "inbox"  # people's proposals (researcher/study/inbox.py)

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"  # the study's code repository (researcher/code/workspace.py)

    @property
    def judges(self) -> Path:
        return self.state / "judges"  # the judges sealed at study start (researcher/code/sealed.py)

    @property
    def trials(self) -> Path:
        return self.state / "trials"  # validation worktrees and smoke logs

    @property
    def diffs(self) -> Path:
        return self.root / "diffs"  # each code proposal's diff, linked from the report

    @property
    def report(self) -> Path:
        return self.root / "report.md"

    @property
    def figures(self) -> Path:
        return self.root / "report"


def study_paths(studies_dir: Path, name: str) -> StudyPaths:
    return StudyPaths(studies_dir / check_name(name))


def load_meta(paths: StudyPaths) -> StudyMeta:
    if not paths.meta.is_file():
        raise StudyError(f"no study at {paths.root} (start one with `researcher study start BRIEF --name NAME`)")
    return StudyMeta.model_validate_json(paths.meta.read_text())


def create_study(paths: StudyPaths, brief_text: str, meta: StudyMeta) -> None:
    if paths.meta.exists():
        raise StudyError(f"study {meta.name} already exists at {paths.root}; use `researcher study resume "
                         f"{meta.name}`, or pick another --name")
    paths.state.mkdir(parents=True, exist_ok=True)
    paths.brief.write_text(brief_text)
    tmp = paths.meta.with_suffix(".tmp")
    tmp.write_text(meta.model_dump_json(indent=1))
    tmp.replace(paths.meta)


def list_studies(studies_dir: Path) -> list[str]:
    if not studies_dir.is_dir():
        return []
    return sorted(p.parent.parent.name for p in studies_dir.glob("*/.study/study.json"))


class StudyLock:
    """Exclusive ownership of a study by this process, with its pid on disk while held."""

    def __init__(self, paths: StudyPaths) -> None:
        self.paths = paths
        self._fh: IO[str] | None = None

    def __enter__(self) -> StudyLock:
        self.paths.state.mkdir(parents=True, exist_ok=True)
        fh = open(self.paths.lock, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise StudyError(f"study {self.paths.root.name} is already running (pid {owner_pid(self.paths)}); "
                             "use `researcher study stop` first") from None
        self._fh = fh
        self.paths.pid.write_text(f"{os.getpid()}\n{now_iso()}\n")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.paths.pid.unlink(missing_ok=True)
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()


def private_paths(paths: StudyPaths, tracking_uri: str) -> list[Path]:
    """What contained proposal code must not read (masked: `swarm contain --hide`): the study's checkpointed
    state (its sqlite files), its record, inbox and launch intents, the local artifact store, and MLflow's
    store when it is a local file (an sqlite database with its journal files, or a file store's folder).
    A tracking server is out of reach another way: a contained process has no network but its swarm server's
    episode routes (core.contain.forwarder)."""
    found = [paths.db, paths.db.with_name(paths.db.name + "-wal"), paths.db.with_name(paths.db.name + "-shm"),
             paths.meta, paths.inbox, paths.state / "launches", paths.state / "artifacts"]
    if tracking_uri.startswith("sqlite:///"):
        store = Path(tracking_uri.removeprefix("sqlite:///"))  # absolute: resolve_tracking_uri made it so
        found += [store, store.with_name(store.name + "-wal"), store.with_name(store.name + "-shm"),
                  store.with_name(store.name + "-journal")]
    elif tracking_uri.startswith("file://") or "://" not in tracking_uri:
        found.append(Path(tracking_uri.removeprefix("file://")))
    return found


class StudyFailed(StudyError):
    """A node of the study raised: the study cannot go on. Its reason is kept in `.study/failed.json`."""


def mark_failed(paths: StudyPaths, node: str, reason: str) -> str:
    """Record that the study failed in `node` and why (status, list and the report show it). -> the line."""
    line = f"failed in {node}: {reason}"
    tmp = paths.failed.with_suffix(".tmp")
    tmp.write_text(json.dumps({"node": node, "reason": reason, "at": now_iso(), "line": line}))
    tmp.replace(paths.failed)
    return line


def failure(paths: StudyPaths) -> str | None:
    """Why the study failed (`mark_failed`), or None while it has not; a resume that gets past it clears it."""
    try:
        return str(json.loads(paths.failed.read_text())["line"])
    except (OSError, ValueError, KeyError):
        return None


def owner_pid(paths: StudyPaths) -> int | None:
    """The pid of the live process driving the study, or None."""
    if not paths.lock.exists():
        return None
    with open(paths.lock, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return int(paths.pid.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return -1  # held, but the pid file is not written yet
        fcntl.flock(fh, fcntl.LOCK_UN)
        return None


# Background resumes started by this machine's commands (`start --detach`, an approve or veto of a study that
# was not running): a person's `stop` must also end one still starting up, or it would take the study over
# after the stop (a README walk on a loaded host: `resume` then found the study "already running").
BACKGROUND = "background.pids"


def note_background(paths: StudyPaths, pid: int) -> None:
    with open(paths.state / BACKGROUND, "a") as fh:
        fh.write(f"{pid}\n")


def stop_background(paths: StudyPaths) -> list[int]:
    """SIGTERM every background resume of this study still alive (checked by its command line, since a pid
    can be reused); -> the pids signalled. The list is emptied."""
    path = paths.state / BACKGROUND
    try:
        pids = [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []
    path.unlink(missing_ok=True)
    signalled = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"resume" in argv and paths.root.name.encode() in argv:
            try:
                os.kill(pid, signal.SIGTERM)
                signalled.append(pid)
            except ProcessLookupError:
                pass
    return signalled


def resume_in_background(paths: StudyPaths) -> int:
    """Resume the study in a background process of its own (its output goes to the study log); -> its pid,
    noted so that a person's `stop` ends it even before it holds the study's lock."""
    paths.state.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "researcher.cli.main", "study", "--studies-dir", str(paths.root.parent),
            "resume", paths.root.name]
    with open(paths.log, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "COLUMNS": "120"})
    note_background(paths, proc.pid)
    return proc.pid
