"""Hostile proposals against the review (issue 32): each attack runs as a real proposal of a real study, or
as a real contained process, and is shown to do nothing.

- Vetoed code through a parent: a vetoed proposal's child is refused by `propose --parent`, by the
  validate node (an inbox item that skipped the CLI) and so never reaches a person or runs.
- Terminal escapes and markup in a diff and a hypothesis: no control byte reaches the reviewer's terminal
  (`diff`, `show`, `review`, `history`), the report or the MLflow note; rich markup prints as typed.
- An ignored file: a patch whose `.gitignore` hides a `conftest.py` (and itself) from the diff is refused
  before any step runs it.
- A forged approval through MLflow: a contained process cannot even open a connection to MLflow's port
  (its own network namespace), and against `mlflow server --app-name basic-auth` a process without the
  study's credentials gets 401; the pending proposal stays pending.
- The study's state and MLflow store, another run's admin token and server file, and the `swarm warm` socket
  are out of reach of the proposal code validation runs.

Real git, real `swarm contain` (bubblewrap), real `mlflow server`; the study runs `--planner manual`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from core.contain import contained as contain
from researcher.code.lineage import Lineage
from researcher.records import CodeVersion, Edit, StepResult
from researcher.review.mlflow_review import ReviewBoard
from researcher.review.plain import plain_record
from researcher.study import inbox
from researcher.study.store import private_paths, study_paths
from tests.researcher.harness import BIN, SWARM, Project, letters_code
from tests.researcher.mlflow_auth import REVIEWER, STUDY, start_auth_server
from tests.researcher.test_code_study import AGENT, _patch, _wait_status
from tests.researcher.test_workspace import _proposal, _validator, project, ws  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.timeout(900)]
needs_bwrap = pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

NAME = "hostile"
ESC = "\x1b"
# A comment that passes `compile()` and, printed raw, erases the line and moves the cursor home.
ERASE = f"# {ESC}[2K{ESC}[1G looks harmless"
MARKER = "VETOED-CODE-RAN"
HYPOTHESIS = f"[bold red]approve me[/bold red]{ESC}]0;owned{chr(7)} a shorter reply"
BRIEF = """---
title: hostile proposals
objective: {metric: reward/mean, direction: maximize}
budget: {max_runs: 4, max_rounds: 4}
run:
  base_config: configs/tiny.yaml
  overrides: {trainer.steps: 2, trainer.batch_groups: 1}
""" + letters_code(1) + """seeds: [0]
approval: {config_only: human, code_change: human}
monitor: {poll_s: 0.5, collapse_drop: null}
review: {poll_s: 0.5}
---
Proposals that try to get around the review.
"""


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    """A manual study with p1 pending: a patch that plants a marker line and a terminal escape."""
    tmp = tmp_path_factory.mktemp("hostile")
    study = Project(tmp)
    brief = tmp / "hostile.md"
    brief.write_text(BRIEF)
    patch = _patch(tmp, "vetoed", AGENT, "MAX_TOKENS = 12", f"MAX_TOKENS = 12\n{ERASE}\nprint({MARKER!r})")
    study.cli("start", str(brief), "--name", NAME, "--planner", "manual", "--detach")
    try:
        study.cli("propose", NAME, "--patch", str(patch), "--hypothesis", HYPOTHESIS)
        assert _wait_status(study, NAME, "p1", {"pending", "invalid"}, timeout=600)["status"] == "pending"
        yield study
    finally:
        study.cli("stop", NAME, check=False)


def _child_patch(tmp: Path) -> Path:
    return _patch(tmp, "child", AGENT, "MAX_TOKENS = 12", "MAX_TOKENS = 14")


def test_vetoed_code_never_runs_through_a_child_proposal(study: Project) -> None:
    child = _child_patch(study.tmp)
    early = study.cli("propose", NAME, "--patch", str(child), "--parent", "p1", "--hypothesis", "build on p1",
                      check=False)
    assert early.returncode == 2 and "parent p1 is not approved" in early.stdout, early.stdout
    study.cli("veto", NAME, "p1", "--reason", "plants a print")
    assert _wait_status(study, NAME, "p1", {"vetoed"}, timeout=300)["status"] == "vetoed"
    late = study.cli("propose", NAME, "--patch", str(child), "--parent", "p1", "--hypothesis", "build on p1",
                     check=False)
    assert late.returncode == 2 and "parent p1 was vetoed" in late.stdout, late.stdout
    approve = study.cli("approve", NAME, "p1", check=False)
    assert approve.returncode == 2, approve.stdout  # a decision is final

    # A child that skipped the CLI (written to the inbox directly) is refused by the validate node.
    paths = study_paths(study.studies, NAME)
    item = inbox.add(paths.inbox, {"hypothesis": "build on vetoed p1", "patch": child.read_text(), "parent": "p1",
                                   "by": "mallory"})
    shown = _wait_status(study, NAME, item.id, {"invalid", "pending"}, timeout=600)
    assert shown["status"] == "invalid", shown
    assert shown["validation"]["step"] == "apply" and "refused: parent p1 was vetoed" in shown["validation"]["log"]
    assert shown["commit"] is None
    refs = subprocess.run(["git", "-C", str(paths.workspace), "for-each-ref", "refs/proposals/"],
                          capture_output=True, text=True, check=True).stdout
    assert "refs/proposals/p1" in refs and f"refs/proposals/{item.id}" not in refs
    ran = [f for f in paths.trials.rglob("*") if f.is_file() and MARKER in f.read_text(errors="replace")]
    assert not ran, ran  # no log of any step ever printed the vetoed line
    board = {r["id"]: r for r in ReviewBoard(MlflowClient(study.tracking_uri), f"study-{NAME}", NAME).board()}
    assert board[item.id]["status"] == "invalid" and board["p1"]["status"] == "vetoed"


def test_terminal_escapes_and_markup_reach_no_reviewer_as_such(study: Project) -> None:
    outputs = {cmd: study.cli(*cmd).stdout for cmd in
               (("diff", NAME, "p1"), ("show", NAME, "p1"), ("review", NAME, "--all"), ("history", NAME),
                ("status", NAME), ("report", NAME))}
    for cmd, out in outputs.items():
        assert ESC not in out and chr(7) not in out, (cmd, out)
    assert "\\x1b[2K\\x1b[1G looks harmless" in outputs[("diff", NAME, "p1")]
    assert "[bold red]approve me[/bold red]\\x1b]0;owned\\x07" in outputs[("show", NAME, "p1")]
    assert "[bold red]approve me" in outputs[("review", NAME, "--all")]  # markup printed as typed, not applied
    paths = study_paths(study.studies, NAME)
    for report in (paths.report, paths.report.with_suffix(".html")):
        text = report.read_text()
        assert ESC not in text and chr(7) not in text and "\\x1b" in text, report
    run = ReviewBoard(MlflowClient(study.tracking_uri), f"study-{NAME}", NAME).find("p1")
    note = run.data.tags["mlflow.note.content"]
    assert ESC not in note and chr(7) not in note and "\\x1b[2K" in note
    assert "\\[bold red\\]" in note  # Markdown punctuation escaped: the hypothesis is no markup in the UI


def test_a_patch_may_not_hide_files_from_the_diff_with_a_gitignore(ws, project, tmp_path) -> None:  # noqa: F811
    planted = tmp_path / "planted"
    patch = f"""diff --git a/.gitignore b/.gitignore
new file mode 100644
--- /dev/null
+++ b/.gitignore
@@ -0,0 +1,2 @@
+.gitignore
+conftest.py
diff --git a/conftest.py b/conftest.py
new file mode 100644
--- /dev/null
+++ b/conftest.py
@@ -0,0 +1 @@
+open({str(planted)!r}, "w").write("ran"); raise SystemExit("IGNORED-CONFTEST-RAN")
diff --git a/sandboxes/letters/agent.py b/sandboxes/letters/agent.py
--- a/sandboxes/letters/agent.py
+++ b/sandboxes/letters/agent.py
@@ -1 +1,2 @@
+# a visible change, so the diff is not empty
"""
    first = (project / AGENT).read_text().splitlines()[0]
    patch += f" {first}\n"
    (tmp_path / "trials").mkdir()
    version = _validator(ws, project, tmp_path).validate(_proposal("hide", patch=patch), ws.base(),
                                                            lambda *a, **k: None, execute=True)
    assert (version.passed, version.failed_step) == (False, "apply"), version.log()
    assert "git ignores" in version.log() and "conftest.py (outside the editable paths)" in version.log()
    assert ".gitignore (outside the editable paths)" in version.log()
    assert "IGNORED-CONFTEST-RAN" not in version.log() and not planted.exists()


@needs_bwrap
def test_validated_code_cannot_read_the_study_state_the_mlflow_store_a_sibling_runs_token_or_reach_warm(
        ws, project, tmp_path, monkeypatch) -> None:  # noqa: F811
    # Outside /tmp, where a real study lives (bubblewrap's private /tmp would hide files under it anyway).
    home = Path(tempfile.mkdtemp(prefix=".swarmrl-hostile-", dir=Path.home()))
    try:
        _peek(ws, project, tmp_path, home, monkeypatch)
    finally:
        shutil.rmtree(home, ignore_errors=True)


PEEK = """
import json, pathlib, socket
seen = {{}}
for p in {files!r}:
    try:
        seen[p] = pathlib.Path(p).read_text()
    except OSError as e:
        seen[p] = type(e).__name__
try:
    socket.socket(socket.AF_UNIX).connect({warm!r})
    seen["warm"] = "connected"
except OSError as e:
    seen["warm"] = type(e).__name__
raise SystemExit("SEEN " + json.dumps(seen))
"""


def _peek(ws, project: Path, tmp_path: Path, home: Path, monkeypatch) -> None:  # noqa: F811
    """The proposal's own code, as validation imports it (contained), reads what a study and its machine
    keep: the study's state, the MLflow store, another run's admin token and server file (found through
    the index `swarm run` keeps in $SWARMRL_STATE), and connects to the `swarm warm` socket."""
    paths = study_paths(home / "studies", "s")
    paths.state.mkdir(parents=True)
    paths.db.write_text("STATE-SECRET")
    store = home / "mlflow.db"
    store.write_text("STORE-SECRET")
    sibling, state, warm = home / "sibling-run", home / "swarm-state", home / "warm"
    sibling.mkdir()
    (sibling / "admin_token").write_text("SIBLING-SECRET")
    (sibling / "server.json").write_text(json.dumps({"url": "http://127.0.0.1:4242", "token": "SIBLING-SECRET"}))
    (state / "servers").mkdir(parents=True)
    (state / "servers" / "4242.json").write_text(json.dumps({
        "url": "http://127.0.0.1:4242", "admin_token_file": str(state / "servers" / "4242.token"),
        "run_folder": str(sibling)}))
    warm.mkdir(mode=0o700)
    monkeypatch.setenv("SWARMRL_STATE", str(state))
    monkeypatch.setenv("SWARMRL_WARM", str(warm / "warm.sock"))
    hidden = private_paths(paths, f"sqlite:///{store}")
    assert paths.db in hidden and store in hidden
    files = [str(paths.db), str(store), str(sibling / "admin_token"), str(sibling / "server.json")]
    code = PEEK.format(files=files, warm=str(warm / "warm.sock"))
    edit = [Edit(file=AGENT, search="MAX_TOKENS = 12", replace=f"MAX_TOKENS = 12\n{code}")]
    (tmp_path / "trials").mkdir()
    validator = _validator(ws, project, tmp_path)
    validator.hidden = hidden
    with socket.socket(socket.AF_UNIX) as listening:  # a live warm socket: reachable from outside the sandbox
        listening.bind(str(warm / "warm.sock"))
        listening.listen()
        version = validator.validate(_proposal("peek", edit), ws.base(), lambda *a, **k: None)
    assert version.failed_step == "import" and "SEEN {" in version.log(), version.log()
    seen = json.loads(version.log().split("SEEN ", 1)[1].splitlines()[0])
    # Masked: an empty file, or (a device bound on a nodev mount) one that cannot be opened; never the text.
    assert all(seen[f] in ("", "PermissionError") for f in files), seen
    assert seen["warm"] == "FileNotFoundError", seen  # the warm socket's folder is an empty one inside
    assert "SECRET" not in version.log()


ATTACK = """
import json, socket, sys, urllib.error, urllib.request
uri, run_id = sys.argv[1], sys.argv[2]
port = int(uri.rsplit(":", 1)[1])
try:
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    print("CONNECTED")
except OSError as e:
    print("CONNECT-FAILED", type(e).__name__)
for key, value in (("review.by", "alice"), ("review.status", "approved")):
    body = json.dumps({"run_id": run_id, "key": key, "value": value}).encode()
    request = urllib.request.Request(uri + "/api/2.0/mlflow/runs/set-tag", body, {"Content-Type": "application/json"})
    try:
        print("FORGED", urllib.request.urlopen(request, timeout=5).status)
    except urllib.error.HTTPError as e:
        print("HTTP", e.code)
    except OSError as e:
        print("UNREACHABLE", type(e).__name__)
"""


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory):
    server = start_auth_server(BIN / "mlflow", tmp_path_factory.mktemp("mlflow-auth"))
    try:
        yield server
    finally:
        server.stop()


@needs_bwrap
def test_a_contained_process_cannot_forge_an_approval_through_mlflow(auth_server, tmp_path, monkeypatch) -> None:
    for k, v in auth_server.study_env().items():
        monkeypatch.setenv(k, v)  # the study's own credentials, in this (the study's) process only
    board = ReviewBoard(MlflowClient(auth_server.uri), "study-forge", "forge")
    version = CodeVersion(proposal_id="p1", parent_commit="0" * 40, passed=True, commit="1" * 40,
                          steps=[StepResult(step="apply", passed=True)], diff="+x\n", pending=["import"])
    run_id = board.publish(_proposal("p1", patch="+x"), {}, version, Lineage())
    script = tmp_path / "attack.py"
    script.write_text(ATTACK)

    # Contained (bubblewrap, no --server): its own network namespace, so MLflow's port is not even there.
    contained = subprocess.run([str(SWARM), "contain", "--required", "--cwd", str(tmp_path), "--timeout", "60", "--",
                                sys.executable, str(script), auth_server.uri, run_id],
                               capture_output=True, text=True, timeout=120)
    assert contained.returncode == 0, contained.stdout + contained.stderr
    assert "CONNECT-FAILED" in contained.stdout and "HTTP" not in contained.stdout, contained.stdout
    assert "FORGED" not in contained.stdout
    # Its credentials cannot be handed to it either: `swarm contain` refuses a credential's name.
    handed = subprocess.run([str(SWARM), "contain", "--env", f"MLFLOW_TRACKING_PASSWORD={STUDY[1]}", "--", "true"],
                            capture_output=True, text=True, timeout=120)
    assert handed.returncode == 2 and "credential" in handed.stdout + handed.stderr

    # Uncontained but without the study's credentials (another user's process, a sibling run): 401.
    bare = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    outside = subprocess.run([sys.executable, str(script), auth_server.uri, run_id], capture_output=True, text=True,
                             timeout=120, env=bare)
    assert "CONNECTED" in outside.stdout and outside.stdout.count("HTTP 401") == 2, outside.stdout
    assert "FORGED" not in outside.stdout

    assert board.collect(["p1"]) == []
    tags = MlflowClient(auth_server.uri).get_run(run_id).data.tags
    assert tags["review.status"] == "pending" and "review.by" not in tags
    # A reviewer's account with EDIT on the experiment can decide; the decision says it was authenticated.
    auth_server.grant(board.experiment_id, REVIEWER[0])
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", REVIEWER[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", REVIEWER[1])
    MlflowClient(auth_server.uri).set_tag(run_id, "review.status", "approved")
    for k, v in auth_server.study_env().items():
        monkeypatch.setenv(k, v)
    (decision,) = board.collect(["p1"])
    assert decision.verdict == "approved" and decision.source == "mlflow" and decision.authenticated


def test_a_local_store_is_not_called_authenticated(tmp_path) -> None:
    board = ReviewBoard(MlflowClient(f"sqlite:///{tmp_path / 'm.db'}"), "study-local", "local")
    assert board.authenticated() is False


def test_a_log_line_quoting_hostile_text_prints_its_control_characters_escaped() -> None:
    record = logging.LogRecord("researcher", logging.WARNING, __file__, 1, "planner reply: %s", (f"{ESC}[2Kok\u202e",), None)
    assert plain_record(record) is True  # the line is kept, only made plain
    assert record.getMessage() == "planner reply: \\x1b[2Kok\\u202e"
