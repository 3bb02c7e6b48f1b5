"""`swarm contain -- ARGV`: runs one command contained and exits with its exit code; at --timeout it kills the
command's whole process group and exits 124; a credential passed with --env, or a limit out of range, is a
one-line refusal. Real `swarm` processes (the command the researcher's validation runs proposal code through)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.researcher.test_contain import SECRETS

ROOT = Path(__file__).resolve().parents[2]


def _contain(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "core.run.cli", "contain", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_it_runs_the_command_without_credentials_and_returns_its_exit_code(tmp_path):
    done = _contain("--writable", str(tmp_path), "--env", "SWARMRL_EPISODE_URL=http://127.0.0.1:1", "--",
                    sys.executable, "-c", "import os, sys; print(sorted(os.environ.items())); sys.exit(7)",
                    cwd=tmp_path, env=SECRETS)
    assert done.returncode == 7, done.stderr
    assert "SWARMRL_EPISODE_URL" in done.stdout and "PATH" in done.stdout
    for value in SECRETS.values():
        assert value not in done.stdout


def test_code_its_starter_imports_from_under_tmp_is_visible_to_the_contained_command(tmp_path):
    # bubblewrap gives the command a private /tmp; a venv or checkout there (tmp_path is under /tmp) is bound back
    code, work = tmp_path / "code", tmp_path / "work"
    code.mkdir()
    work.mkdir()
    (code / "marker_module.py").write_text("WHERE = 'seen'\n")
    assert str(tmp_path).startswith("/tmp/")
    done = _contain("--env", f"PYTHONPATH={code}", "--", sys.executable, "-c",
                    "import marker_module; print(marker_module.WHERE)", cwd=work,
                    env={"PYTHONPATH": f"{ROOT}:{code}"})
    assert done.returncode == 0 and "seen" in done.stdout, done.stderr


def test_a_command_killed_by_a_signal_exits_128_plus_the_signal(tmp_path):
    done = _contain("--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", cwd=tmp_path)
    assert done.returncode == 128 + 9, done.stderr


def test_at_the_timeout_the_whole_process_group_is_killed_and_it_exits_124(tmp_path):
    started = time.monotonic()
    done = _contain("--writable", str(tmp_path), "--timeout", "2", "--", sys.executable, "-c", """
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', "import time; time.sleep(4); open('survived', 'w').write('x')"])
time.sleep(600)
""", cwd=tmp_path)
    assert done.returncode == 124, done.stderr
    assert "timed out after 2 s; its process group was killed" in done.stderr
    assert time.monotonic() - started < 60
    time.sleep(5)  # the grandchild would have written by now
    assert not (tmp_path / "survived").exists()


def test_a_credential_or_a_bad_limit_is_refused_in_one_line(tmp_path):
    secret = _contain("--env", "OPENAI_API_KEY=sk-x", "--", "true", cwd=tmp_path)
    assert secret.returncode == 2 and "OPENAI_API_KEY looks like a credential" in secret.stderr
    limit = _contain("--processes", "0", "--", "true", cwd=tmp_path)
    assert limit.returncode == 2, limit.stderr
    assert limit.stderr.strip().count("\n") == 0 and "--processes: Input should be greater than or equal to 1" in limit.stderr


def test_required_without_bwrap_refuses_and_names_the_fix(tmp_path):
    done = _contain("--required", "--", "true", cwd=tmp_path, env={"PATH": str(tmp_path)})
    assert done.returncode == 2
    assert "apt-get install bubblewrap" in " ".join(done.stderr.split())


# An editable install's import hook, reduced: `core` from CHECKOUT, which no sys.path entry names.
_HOOK = """import sys
from importlib.machinery import PathFinder
class _Editable:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return PathFinder.find_spec(name, [{checkout!r}]) if name == "core" else None
sys.meta_path.insert(0, _Editable)
"""


def test_an_editable_checkout_under_tmp_on_no_sys_path_entry_is_visible_to_the_contained_command(tmp_path):
    # A fresh clone under /tmp with an editable install: its `core` is found by the install's import hook, not
    # through sys.path; the contained `swarm` of a study's smoke step must still import that same `core`.
    checkout, starter, work = tmp_path / "checkout", tmp_path / "starter", tmp_path / "work"
    shutil.copytree(ROOT / "core", checkout / "core", ignore=shutil.ignore_patterns("__pycache__"))
    starter.mkdir()
    work.mkdir()
    hook = _HOOK.format(checkout=str(checkout))
    inner = hook + "import core.run.cli\nprint('core from', core.__file__)\n"
    (starter / "start.py").write_text(hook + "from core.run.cli import app\napp()\n")
    done = subprocess.run([sys.executable, str(starter / "start.py"), "contain", "--", sys.executable, "-c", inner],
                          cwd=work, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"core from {checkout / 'core' / '__init__.py'}" in done.stdout, done.stdout + done.stderr


def test_a_refusal_prints_the_callers_text_as_typed_never_as_markup(tmp_path):
    done = _contain("--env", "[bold red]KEY-without-a-value[/bold red]", "--", "true", cwd=tmp_path)
    assert done.returncode == 2
    assert "[bold red]KEY-without-a-value[/bold red]" in done.stdout + done.stderr, done.stdout + done.stderr
