"""Contained proposal code (core/contain/contained.py, which validation reaches through `swarm contain`): it
sees no secret, writes only its worktree (under bwrap), and a fork bomb, a memory hog or a hang is stopped
by the limits. Real processes; bwrap from Debian's `bubblewrap` (the Makefile's test set-up installs it;
the filesystem test skips only where it is absent)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from core.contain import contained as contain
from core.contain.contained import contained_env, run_contained
from core.config import ContainLimits as Limits
from researcher.runs.launcher import run_env
from researcher.study.store import private_paths, study_paths

SECRETS = {"OPENAI_API_KEY": "sk-secret-openai", "MLFLOW_TRACKING_TOKEN": "mlflow-secret",
           "MLFLOW_TRACKING_PASSWORD": "mlflow-password", "SWARMRL_ADMIN_TOKEN": "admin-secret",
           "AWS_SECRET_ACCESS_KEY": "aws-secret", "GOOGLE_APPLICATION_CREDENTIALS": "/keys/google.json",
           "AZURE_CLIENT_SECRET": "azure-secret", "HF_TOKEN": "hf-secret", "GITHUB_TOKEN": "gh-secret"}


def _py(code: str, tree: Path, timeout_s: float = 60, limits: Limits = Limits(), **kw) -> tuple[int | None, str]:
    return run_contained([sys.executable, "-c", code], tree, timeout_s=timeout_s, writable=[tree], limits=limits, **kw)


def test_code_that_prints_its_environment_shows_no_secret(tmp_path: Path, monkeypatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    code, out = _py("import os; print(sorted(os.environ.items()))", tmp_path,
                    extra_env={"SWARMRL_EPISODE_URL": "http://127.0.0.1:1"})
    assert code == 0, out
    for value in SECRETS.values():
        assert value not in out
    assert "SWARMRL_EPISODE_URL" in out and str(Path.home()) + "'" not in out  # a HOME of its own


def test_a_secret_passed_on_purpose_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="OPENAI_API_KEY looks like a credential"):
        contained_env(tmp_path, {"OPENAI_API_KEY": "sk-x"})


@pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_under_bwrap_code_writes_its_worktree_but_nothing_outside(tmp_path: Path) -> None:
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    tree.mkdir(), outside.mkdir()
    this_file = Path(__file__).read_text()
    code, out = _py(f"""
from pathlib import Path
Path('inside.txt').write_text('ok')
for target in ({str(outside / 'planted.py')!r}, {str(Path(__file__).resolve())!r}):
    try:
        open(target, 'a').write('# planted')
        print('WROTE', target)
    except OSError as e:
        print('refused', target, type(e).__name__)
""", tree)
    assert code == 0, out
    assert (tree / "inside.txt").read_text() == "ok"
    assert "WROTE" not in out and out.count("refused") == 2, out
    assert not (outside / "planted.py").exists() and Path(__file__).read_text() == this_file


BOMB = """
import os, sys, time
n = 0
try:
    for _ in range(3000):
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        n += 1
except OSError as e:
    print('stopped after', n, type(e).__name__)
    sys.exit(3)
print('forked', n)
"""


def test_a_fork_bomb_is_stopped_by_the_process_limit(tmp_path: Path) -> None:
    code, out = _py(BOMB, tmp_path, limits=Limits(processes=64))
    assert code == 3 and "stopped after" in out, out
    assert int(out.split("stopped after")[1].split()[0]) < 200


def test_a_memory_hog_is_stopped_by_the_address_space_limit(tmp_path: Path) -> None:
    code, out = _py("x = bytearray(6 * 1024 ** 3)\nprint('allocated')", tmp_path, limits=Limits(address_space=2 * 1024 ** 3))
    assert code != 0 and "MemoryError" in out and "allocated" not in out, out


def test_at_the_timeout_the_whole_process_group_is_killed(tmp_path: Path) -> None:
    started = time.monotonic()
    code, out = _py("""
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', "import time; time.sleep(3); open('survived', 'w').write('x')"])
time.sleep(600)
""", tmp_path, timeout_s=2)
    assert code is None and time.monotonic() - started < 30
    time.sleep(4)
    assert not (tmp_path / "survived").exists()


def test_a_core_run_of_proposal_code_gets_no_secret_but_its_mlflow_credentials(monkeypatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    code_run = run_env("abc123", "sqlite:///x.db")
    assert code_run["MLFLOW_TRACKING_URI"] == "sqlite:///x.db"
    assert code_run["MLFLOW_TRACKING_TOKEN"] == "mlflow-secret"  # the run's own telemetry needs it
    assert not {"OPENAI_API_KEY", "SWARMRL_ADMIN_TOKEN", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} & set(code_run)
    assert run_env(None, "sqlite:///x.db")["OPENAI_API_KEY"] == "sk-secret-openai"  # a config run: unchanged


@pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_studys_runs_hide_its_state_and_mlflow_store_from_their_contained_clients(tmp_path: Path, monkeypatch,
                                                                                    request) -> None:
    """The study names its private paths to every core run it starts (run_env → $SWARMRL_CONTAIN_HIDE), and the
    core masks them in the clients it contains: a client of such a run reads neither the study's state nor its store."""
    home = Path(tempfile.mkdtemp(dir="/var/tmp"))  # outside /tmp, which the sandbox's private /tmp hides anyway
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    paths = study_paths(home / "studies", "s")
    paths.db.parent.mkdir(parents=True)
    paths.db.write_text("checkpointed decisions")
    store = home / "mlflow.db"
    store.write_text("every run's metrics")
    hidden = private_paths(paths, f"sqlite:///{store}")
    env = run_env("abc123", f"sqlite:///{store}", hidden=hidden)
    for key in [k for k in os.environ if k.startswith("SWARMRL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SWARMRL_CONTAIN_HIDE", env["SWARMRL_CONTAIN_HIDE"])  # as the run's process has it
    tree = tmp_path / "client"
    tree.mkdir()
    code, out = _py(f"""
for path in ({str(paths.db)!r}, {str(store)!r}):
    try:
        print(path, repr(open(path).read()))
    except OSError as e:
        print(path, type(e).__name__)
""", tree)
    assert code == 0, out
    assert "checkpointed decisions" not in out and "every run's metrics" not in out, out
    assert str(paths.db) in out and str(store) in out, out
    # Without the study's names the same files are readable: the mask, not the sandbox's view, hides them.
    monkeypatch.delenv("SWARMRL_CONTAIN_HIDE")
    code, out = _py(f"print(open({str(store)!r}).read())", tree)
    assert code == 0 and "every run's metrics" in out, out
