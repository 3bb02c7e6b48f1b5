"""The README's command blocks, run in order against real processes: a README edit that breaks a command fails CI.

Convention (README authors: read this before adding a command):

- Every ```bash block of README.md runs, top to bottom, in one scratch folder that holds copies of
  `configs/`, `sandboxes/` and `studies/*.md`, with its own MLflow store (`sqlite:///mlflow.db`
  there) and its own `SWARMRL_STATE`. One line is one command; text after `  #` is a comment.
  ```python blocks run too (with the venv's interpreter), in the same order among the bash blocks.
- `source .venv/bin/activate` is honoured by putting the venv's `bin/` first on PATH.
- Port 8000 is the README's server port: every `127.0.0.1:8000` and `--port 8000` becomes a free port.
- A command passes when it exits 0 within its timeout. A failure shows the command and its output.
- A command's trailing comment may end with a CI mark in square brackets, words separated by commas:
  - `[ci: tiny]`: run with the `tiny` model instead of `smollm2-135m` (the only substitution made),
    so the command stays fast; the command must work with both.
  - `[ci: background]`: a long-running command (`swarm serve`, `swarm client`). The test starts it in
    the background and waits until it is up (`swarm serve`: `/v1/models` answers; `swarm client`: its
    pid file exists). It keeps running through the python blocks that follow its bash block, and is
    stopped with SIGTERM when the next bash block starts (or the README ends); it must then exit 0
    within a bound. Clients that `swarm swap` started are stopped the same way.
  - `[ci: skip: REASON]`: not run in CI, only for a command that cannot run there (minutes of CPU, a
    GPU, a remote service); REASON says which. A skip without a reason fails the test.
  Example: `swarm serve --model smollm2-135m --port 8000   # no training  [ci: tiny, background]`.
- Files a command needs must come from the repository or from an earlier README command.
- A ```bash block whose first line is `# [ci: skip: REASON]` is skipped as a whole (e.g. `make`
  targets that rebuild the venv).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
README_PORT = "8000"
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.DOTALL | re.MULTILINE)
MARK = re.compile(r"\[ci:([^\]]*)\]\s*$")
MARK_WORDS = {"tiny", "background", "skip"}
COMMAND_TIMEOUT_S = 900  # `swarm run configs/tiny.yaml` on a busy 2-core machine, with room
UP_TIMEOUT_S = 300  # a background server loads its model; a client imports its sandbox
STOP_BOUND_S = 120  # a client drains for at most one lease (60 s by default), then exits


@dataclass
class Command:
    text: str  # as the README writes it (comment stripped)
    language: str  # bash | python
    block: int = 0  # which bash block it belongs to (python blocks count with the bash block before them)
    tiny: bool = False
    background: bool = False
    skip: str | None = None  # the reason, when skipped

    def for_ci(self, port: int) -> str:
        text = self.text.replace("smollm2-135m", "tiny") if self.tiny else self.text
        return text.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}").replace(
            f"--port {README_PORT}", f"--port {port}")


def parse_mark(line: str) -> dict:
    """The CI mark at the end of a line: {'tiny': bool, 'background': bool, 'skip': reason | None}."""
    found = MARK.search(line)
    out: dict = {"tiny": False, "background": False, "skip": None}
    if not found:
        return out
    for word in (w.strip() for w in found.group(1).split(",")):
        key, _, reason = word.partition(":")
        key = key.strip()
        if key not in MARK_WORDS:
            raise ValueError(f"unknown CI mark {key!r} in {line!r}; known: {sorted(MARK_WORDS)}")
        if key == "skip":
            if not reason.strip():
                raise ValueError(f"a skipped command must say why: [ci: skip: REASON] in {line!r}")
            out["skip"] = reason.strip()
        else:
            out[key] = True
    return out


def readme_commands(text: str) -> list[Command]:
    """Every command of the README's bash and python blocks, in order, with its CI mark."""
    commands, block = [], 0
    for language, body in FENCE.findall(text):
        lines = body.splitlines()
        if language == "python":
            mark = parse_mark(lines[0]) if lines and lines[0].startswith("#") else parse_mark("")
            commands.append(Command(body, "python", block, **mark))
            continue
        block += 1
        block_mark = parse_mark(lines[0]) if lines and lines[0].lstrip().startswith("#") else parse_mark("")
        for line in lines:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            mark = parse_mark(line)
            if block_mark["skip"]:
                mark["skip"] = block_mark["skip"]
            command = shlex.join(shlex.split(line, comments=True))
            commands.append(Command(command, "bash", block, **mark))
    return commands


def test_ci_marks_are_read_and_a_skip_needs_a_reason() -> None:
    text = ("```bash\nswarm serve --model smollm2-135m --port 8000   # no training  [ci: tiny, background]\n"
            "swarm run configs/big.yaml   # slow  [ci: skip: ten minutes of CPU]\nswarm models\n```\n")
    serve, big, models = readme_commands(text)
    assert serve.tiny and serve.background and serve.for_ci(1234) == "swarm serve --model tiny --port 1234"
    assert big.skip == "ten minutes of CPU" and not models.skip and models.text == "swarm models"
    with pytest.raises(ValueError, match="must say why"):
        readme_commands("```bash\nswarm run x   # [ci: skip]\n```\n")
    with pytest.raises(ValueError, match="unknown CI mark 'fast'"):
        readme_commands("```bash\nswarm run x   # [ci: fast]\n```\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scratch(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for folder in ("configs", "sandboxes"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__", ".study"))
    (work / "studies").mkdir()
    for brief in (ROOT / "studies").glob("*.md"):
        shutil.copy(brief, work / "studies" / brief.name)
    return work


def _pid_files(state: Path) -> set[Path]:
    return set(state.glob("*.pid"))


class Session:
    """The README's processes: foreground commands run to completion, background ones are tracked and stopped."""

    def __init__(self, work: Path, port: int):
        self.work, self.port, self.state = work, port, work / "state"
        self.env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the README's default store
        self.env.update(SWARMRL_STATE=str(self.state), COLUMNS="120")
        self.background: list[tuple[int, str, subprocess.Popen, Path]] = []
        self.problems: list[str] = []

    def activate(self) -> None:
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"

    def run(self, command: Command) -> None:
        if command.language == "bash" and any(block != command.block for block, *_ in self.background):
            self.problems += self.stop()  # a new bash block: the previous block's servers and clients stop
        text = command.for_ci(self.port)
        log = self.work / f"cmd-{len(list(self.work.glob('cmd-*.log')))}.log"
        argv = [sys.executable, "-c", text] if command.language == "python" else shlex.split(text)
        if command.background:
            self._start(command.block, text, argv, log)
            return
        with open(log, "wb") as out:
            proc = subprocess.run(argv, cwd=self.work, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=COMMAND_TIMEOUT_S)
        assert proc.returncode == 0, f"README command failed ({proc.returncode}): {text}\n{log.read_text()[-3000:]}"

    def _start(self, block: int, text: str, argv: list[str], log: Path) -> None:
        before = _pid_files(self.state)
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.background.append((block, text, proc, log))
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"README background command exited ({proc.returncode}): {text}\n{log.read_text()[-3000:]}"
            if " serve " in f" {text} " and self._serving():
                return
            if " client " in f" {text} " and _pid_files(self.state) - before:
                return
            time.sleep(0.5)
        raise AssertionError(f"README background command did not come up: {text}\n{log.read_text()[-3000:]}")

    def _serving(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> list[str]:
        """SIGTERM everything still running (detached clients by their pid files); each must exit 0 in time."""
        problems = []
        for pid_file in _pid_files(self.state):  # clients `swarm swap` started, detached from the test
            os.kill(json.loads(pid_file.read_text())["pid"], signal.SIGTERM)
        deadline = time.monotonic() + STOP_BOUND_S  # clients first: they drain against a live server
        while _pid_files(self.state) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _pid_files(self.state):
            problems.append(f"client pid files left behind: {sorted(p.name for p in _pid_files(self.state))}")
        for _, text, proc, log in reversed(self.background):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=STOP_BOUND_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                problems.append(f"did not stop within {STOP_BOUND_S}s of SIGTERM: {text}")
                continue
            if code != 0:
                problems.append(f"exited {code} on SIGTERM: {text}\n{log.read_text()[-2000:]}")
        self.background = []
        return problems


@pytest.mark.slow
@pytest.mark.timeout(1500)  # every README command in turn: ~5 min on a quiet 2-core machine, far more on a busy one
def test_readme_commands_run_in_order(tmp_path: Path) -> None:
    commands = readme_commands((ROOT / "README.md").read_text())
    assert any(c.text.startswith("swarm serve") for c in commands)  # the parser found the blocks
    session = Session(_scratch(tmp_path), _free_port())
    try:
        for command in commands:
            if command.skip:
                continue
            if command.text == "source .venv/bin/activate":
                session.activate()
                continue
            session.run(command)
    finally:
        problems = session.problems + session.stop()
    assert not problems, "\n".join(problems)
