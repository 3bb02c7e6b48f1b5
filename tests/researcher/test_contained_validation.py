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
from tests.researcher.test_workspace import _proposal, _validator, project, ws  # noqa: F401 (fixtures)

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
