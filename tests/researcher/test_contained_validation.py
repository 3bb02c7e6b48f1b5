"""Validation runs a proposal's code contained: the import step of an edit that prints its environment
shows no secret, and one that hogs memory or forks without end fails at its step while the next
proposal still validates (the study goes on). Real git, real contained subprocesses."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from core.contain import contained as contain
from core.config import ContainLimits as Limits
from researcher.records import Edit
from tests.researcher.test_contain import SECRETS
from researcher.brief.loader import parse_brief
from tests.researcher.test_workspace import BRIEF, _proposal, _validator, project, ws  # noqa: F401 (fixtures)

HOOK = "MAX_TOKENS = 12"


def _edit(code: str) -> list[Edit]:
    return [Edit(file="sandboxes/letters/agent.py", search=HOOK, replace=f"{HOOK}\n{code}")]


def test_proposal_code_that_prints_its_environment_shows_no_secret(ws, project, tmp_path, monkeypatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "trials").mkdir()
    version = _validator(ws, project, tmp_path).validate(
        _proposal("env", _edit("import os\nraise SystemExit('ENV ' + repr(sorted(os.environ.items())))")),
        ws.base(), lambda *a, **k: None)
    assert (version.passed, version.failed_step) == (False, "import")
    assert "ENV [" in version.log() and "PATH" in version.log()
    for value in SECRETS.values():
        assert value not in version.log()


@pytest.mark.parametrize("name, code", [
    ("hog", "x = bytearray(6 * 1024 ** 3)"),
    ("bomb", "import os, time\nfor _ in range(3000):\n    if os.fork() == 0:\n        time.sleep(2)\n        os._exit(0)"),
])
def test_a_memory_hog_or_fork_bomb_fails_its_step_and_the_next_proposal_still_validates(
        ws, project, tmp_path, name, code) -> None:
    (tmp_path / "trials").mkdir()
    validator = _validator(ws, project, tmp_path)
    validator.limits = Limits(address_space=2 * 1024 ** 3, processes=64)
    base = ws.base()
    version = validator.validate(_proposal(name, _edit(code)), base, lambda *a, **k: None)
    assert (version.passed, version.failed_step) == (False, "import"), version.log()
    assert ("MemoryError" if name == "hog" else "BlockingIOError") in version.log()
    after = validator.validate(_proposal("next", _edit("raise SystemExit('next one ran')")), base, lambda *a, **k: None)
    assert after.failed_step == "import" and "next one ran" in after.log()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ws.root, capture_output=True, text=True).stdout
    assert len(worktrees.splitlines()) == 1


@pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_the_studys_warm_socket_is_masked_from_proposal_code(ws, project, tmp_path, request) -> None:
    # docs/security.md promised it; a listener at .study/warm/warm.sock got a message from inside bubblewrap.
    # Outside /tmp: the sandbox's private /tmp would hide a socket under pytest's tmp_path anyway.
    study = Path(tempfile.mkdtemp(prefix="swarmrl-test-study-", dir="/var/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(study, ignore_errors=True))
    (tmp_path / "trials").mkdir()
    warm = study / ".study" / "warm" / "warm.sock"
    warm.parent.mkdir(parents=True, mode=0o700)
    validator = _validator(ws, project, tmp_path)
    validator.warm = str(warm)
    probe = ("import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(" + repr(str(warm)) + ")\n"
             "    s.sendall(b'from the proposal')\n    raise SystemExit('WARM reached')\n"
             "except OSError as e:\n    raise SystemExit('WARM ' + type(e).__name__)")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(warm))
        listener.listen()
        listener.settimeout(0.1)
        version = validator.validate(_proposal("warm", _edit(probe)), ws.base(), lambda *a, **k: None)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing connected
    assert version.failed_step == "import" and "WARM FileNotFoundError" in version.log(), version.log()


SWAP_DOTGIT = """
import os as _os, pathlib as _pathlib, subprocess as _subprocess
_tree = _pathlib.Path(__file__).resolve().parents[2]
if (_tree / ".git").is_file():  # the trial worktree's link to the study's repository
    (_tree / ".git").unlink()
    _subprocess.run(["git", "init", "-q", str(_tree)], check=True)
    (_tree / "fsmonitor.sh").write_text("#!/bin/sh\\nenv > {marker}\\necho '{{}}'\\n")
    _os.chmod(_tree / "fsmonitor.sh", 0o755)
    for _key, _value in (("core.fsmonitor", str(_tree / "fsmonitor.sh")), ("core.hooksPath", str(_tree))):
        _subprocess.run(["git", "-C", str(_tree), "config", _key, _value], check=True)
    for _hook in ("post-commit", "post-checkout", "reference-transaction"):
        (_tree / _hook).write_text("#!/bin/sh\\nenv > {marker}\\n")
        _os.chmod(_tree / _hook, 0o755)
"""


@pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
@pytest.mark.parametrize("mode", ["execute_before_review", "approval_auto", "after_human_approval"])
def test_a_dotgit_swapped_inside_the_trial_tree_runs_nothing_on_the_host(ws, project, tmp_path, monkeypatch, mode):
    # The trial tree is writable to proposal code and held the link to the study's repository: code replaced it
    # by a repository whose core.fsmonitor was its own script, and the study's uncontained `git diff --cached`
    # and `git commit` ran that script on the host, with the study's OPENAI_API_KEY in its environment.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-studys-key")
    (tmp_path / "trials").mkdir()
    marker = tmp_path / "ran-on-the-host"
    brief_flags = {"execute_before_review": "execute_before_review: true", "approval_auto": "",
                   "after_human_approval": ""}[mode]
    text = BRIEF.replace("readonly: [sandboxes/letters/reward.py]}",
                         f"readonly: [sandboxes/letters/reward.py]{', ' + brief_flags if brief_flags else ''}}}")
    if mode == "approval_auto":
        text = text.replace("---\n", "---\napproval: {code_change: auto}\n", 1)
    brief = parse_brief(text, workdir=project)
    validator = _validator(ws, project, tmp_path)
    validator.brief = brief
    monkeypatch.setattr(validator, "_smoke", lambda p, tree: "smoke: not run by this test")
    execute_first = brief.approval.code_change == "auto" or bool(brief.code.execute_before_review)  # the study's rule
    assert execute_first == (mode != "after_human_approval")
    proposal = _proposal("swap", _edit(SWAP_DOTGIT.format(marker=marker)))
    version = validator.validate(proposal, ws.base(), lambda *a, **k: None, execute=execute_first)
    if not execute_first:  # approved by a person: its executing steps run now, on its commit
        assert version.passed and version.pending, version.log()
        version = validator.execute(proposal, version, lambda *a, **k: None)
    assert not marker.exists(), marker.read_text()[:2000]
    assert (version.passed, version.failed_step) == (False, "import"), version.log()
    assert "the trial tree's .git" in version.log(), version.log()
    assert ws.commit_of("swap") is None
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ws.root, capture_output=True, text=True).stdout
    assert len(worktrees.splitlines()) == 1, worktrees
