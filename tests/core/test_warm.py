"""`swarm warm`: `swarm run` forked from a process with its imports done behaves as a cold one does.

Real processes throughout: a `swarm warm` process, `swarm run` launchers on the tiny config, and the
forked runs, whose pids the warm process logs. The launcher's exit code, its relayed Ctrl-C, its death
and the fallback to a cold start are each checked against what a cold `swarm run` does. Who may use it
is attacked with real processes: a request from inside bubblewrap, a fake server run as another user, a
command other than run and serve, a socket path that is a person's file.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from core.run import checkpoint, warm

ROOT = Path(__file__).resolve().parents[2]
SWARM = Path(sys.executable).parent / "swarm"
TINY = str(ROOT / "configs" / "tiny.yaml")


@dataclass
class Warm:
    socket: Path
    log: Path

    def forked_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"forked pid (\d+)", self.log.read_text())]

    def forked_since(self, before: list[int]) -> int:
        """The one run forked since `before` was read (a run that started cold fails here)."""
        new = self.forked_pids()[len(before):]
        assert len(new) == 1, self.log.read_text()[-2000:]
        return new[0]


@pytest.fixture(scope="module")
def warm_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Warm]:
    """One warm process for the module (its imports cost a cold start); tests count the forks they caused."""
    folder = tmp_path_factory.mktemp("warm")
    path, log = folder / "warm.sock", folder / "warm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(SWARM), "warm", "--socket", str(path)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield Warm(path, log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not path.exists(), "a stopped warm process removes its socket"


def _run(tmp_path: Path, warm_socket: Path | str, *args: str, preexec_fn=None, **env: str) -> subprocess.Popen[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [str(SWARM), "run", TINY, "--quiet", "--set", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec_fn,
                            env={**os.environ, "SWARMRL_WARM": str(warm_socket),
                                 "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", **env})


def _wait_for(proc: subprocess.Popen[str], text: str, timeout: float = 240) -> str:
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen:
        line = proc.stdout.readline()
        assert (line or proc.poll() is None) and time.monotonic() < deadline, seen[-3000:]
        seen += line
    return seen


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "State:\tZ" in state:
            return True
        time.sleep(0.1)
    return False


def test_a_run_forked_from_the_warm_process_trains_logs_and_exits_zero_after_a_garbage_request(
        warm_process: Warm, tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:  # no descriptors, no header: refused
        peer.connect(str(warm_process.socket))
        peer.sendall(b"not a request\n")
        assert b"refused" in peer.recv(4096)
    before = warm_process.forked_pids()
    proc = _run(tmp_path, warm_process.socket, "--set", "trainer.steps=2")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "starting cold" not in out and "step 2 reward" in out, out[-3000:]
    warm_process.forked_since(before)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and "reward/mean" in run.data.metrics
    assert checkpoint.load_latest(tmp_path / "ckpt").step == 2


def test_ctrl_c_to_the_launcher_reaches_the_forked_run_which_checkpoints_and_exits_130(
        warm_process: Warm, tmp_path: Path) -> None:
    before = warm_process.forked_pids()
    proc = _run(tmp_path, warm_process.socket, "--set", "trainer.steps=1000")
    _wait_for(proc, "step 2 ")
    forked = warm_process.forked_since(before)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]  # what a cold `swarm run` exits with (test_run.py)
    assert checkpoint.load_latest(tmp_path / "ckpt").step >= 2
    assert _gone(forked)


def test_a_killed_launcher_takes_its_forked_run_with_it_and_a_killed_run_its_launcher(
        warm_process: Warm, tmp_path: Path) -> None:
    before = warm_process.forked_pids()
    first = _run(tmp_path / "a", warm_process.socket, "--set", "trainer.steps=1000")
    _wait_for(first, "step 1 ")
    forked = warm_process.forked_since(before)
    first.kill()
    first.wait(timeout=30)
    assert _gone(forked), f"forked run {forked} outlived its killed launcher"
    before = warm_process.forked_pids()
    second = _run(tmp_path / "b", warm_process.socket, "--set", "trainer.steps=1000")
    _wait_for(second, "step 1 ")
    os.kill(warm_process.forked_since(before), signal.SIGKILL)
    second.communicate(timeout=60)
    assert second.returncode == -signal.SIGKILL  # the launcher dies of its run's signal, as a cold run would


def test_a_second_warm_process_on_a_live_socket_refuses_to_start(warm_process: Warm) -> None:
    done = subprocess.run([str(SWARM), "warm", "--socket", str(warm_process.socket)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "another warm process listens at" in done.stderr, done.stderr
    assert warm_process.socket.exists()


def test_a_launcher_whose_import_time_environment_differs_starts_cold_and_says_which_variable(
        warm_process: Warm, tmp_path: Path) -> None:
    before = warm_process.forked_pids()
    proc = _run(tmp_path, warm_process.socket, "--set", "trainer.steps=1", HF_HUB_DISABLE_TELEMETRY="1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "a different $HF_HUB_DISABLE_TELEMETRY); starting cold" in out and "step 1 reward" in out, out[-3000:]
    assert warm_process.forked_pids() == before


def test_no_warm_process_at_the_socket_means_a_cold_start_with_a_warning(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SWARMRL_WARM", str(tmp_path / "nobody.sock"))
    assert warm.delegate() is None
    assert "did not answer" in capsys.readouterr().err
    monkeypatch.delenv("SWARMRL_WARM")
    assert warm.delegate() is None  # not asked for: nothing said


def test_the_source_stamp_changes_with_any_edit_addition_or_removal(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    first = warm.source_stamp(tmp_path)
    os.utime(tmp_path / "a.py", ns=(time.time_ns(), time.time_ns() + 10**9))
    edited = warm.source_stamp(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("")
    added = warm.source_stamp(tmp_path)
    (tmp_path / "sub" / "b.py").unlink()
    assert len({first, edited, added}) == 3 and warm.source_stamp(tmp_path)[0] == first[0]


# --- who may use it (core.run.warm_peer) -------------------------------------------------------------

# A hostile process that talks to the warm socket itself: it builds the request a launcher would (the same
# Python, import path and environment, so the warm process would fork for it) and skips the launcher's own
# check of the server. It prints what `delegate` returned: an exit code when a child was forked for it.
ATTACKER = """
import json, sys
sys.path[0] = {bin!r}  # as the `swarm` script's, so its identity matches the warm process's
from core.run import warm
warm.peer_refusal = lambda *_: None  # a hostile client does not check the server
sys.argv = {argv!r}
print(json.dumps({{"delegated": warm.delegate()}}), flush=True)
"""


def _attack(warm_socket: Path, argv: list[str], wrapper: list[str] = ()) -> subprocess.CompletedProcess[str]:
    code = ATTACKER.format(bin=str(SWARM.parent), argv=argv)
    return subprocess.run([*wrapper, sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SWARMRL_WARM": str(warm_socket)})


def test_the_attacker_helper_gets_a_fork_when_nothing_stops_it(warm_process: Warm) -> None:
    """The control for the two attacks below: the same request, from beside the warm process, is forked."""
    before = warm_process.forked_pids()
    done = _attack(warm_process.socket, [str(SWARM), "run", "--help"])
    assert '{"delegated": 0}' in done.stdout, done.stdout + done.stderr
    warm_process.forked_since(before)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_process_inside_bubblewrap_that_reaches_the_socket_gets_nothing_forked(warm_process: Warm) -> None:
    before = warm_process.forked_pids()
    sandbox = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "--die-with-parent",
               "--bind", str(warm_process.socket.parent), str(warm_process.socket.parent), "--"]
    done = _attack(warm_process.socket, [str(SWARM), "run", "--help"], sandbox)
    assert '{"delegated": null}' in done.stdout, done.stdout + done.stderr
    assert "the launcher runs in another pid and mnt namespace (a sandbox)" in done.stderr, done.stderr
    assert warm_process.forked_pids() == before
    assert "refused a peer" in warm_process.log.read_text()


def test_it_forks_only_run_and_serve(warm_process: Warm) -> None:
    before = warm_process.forked_pids()
    for command in ("client", "contain", "swap", "warm"):
        done = _attack(warm_process.socket, [str(SWARM), command, "--help"])
        assert '{"delegated": null}' in done.stdout, done.stdout + done.stderr
        assert f"it forks only `swarm run` and `swarm serve`, not {command}" in done.stderr, done.stderr
    assert warm_process.forked_pids() == before


FAKE_SERVER = """
import socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
open(sys.argv[2], "w").close()  # listening
conn, _ = listener.accept()
conn.settimeout(10)
got = b""
try:
    while chunk := conn.recv(65536):
        got += chunk
except OSError:
    pass
open(sys.argv[2], "wb").write(b"received:" + got)
try:
    conn.sendall(b'{"pid": 1}\\n{"exit": 0}\\n')  # a server that never ran says it ran
except OSError:
    pass  # the launcher hung up on it
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run the fake server as another user")
def test_a_fake_warm_server_of_another_user_gets_nothing_from_a_launcher(request, monkeypatch, capsys) -> None:
    shared = Path(tempfile.mkdtemp(prefix="swarmrl-shared-", dir="/tmp"))  # tmp_path is root's only
    shared.chmod(0o777)  # as /tmp is: anyone may put a socket there
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    sock, seen = shared / "swarm.sock", shared / "seen"
    fake = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c",
                             FAKE_SERVER, str(sock), str(seen)])
    try:
        deadline = time.monotonic() + 30
        while not seen.exists():
            assert fake.poll() is None and time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.05)
        monkeypatch.setenv("SWARMRL_WARM", str(sock))
        monkeypatch.setenv("OPENAI_API_KEY", "sk-the-launchers-secret")
        assert warm.delegate() is None  # it starts cold instead
        assert fake.wait(timeout=30) == 0
    finally:
        fake.kill()
    assert "the warm process runs as uid 65534, not this user's (0); sent it nothing" in capsys.readouterr().err
    assert seen.read_bytes() == b"received:"  # not one byte: no environment, no descriptors


def test_a_socket_path_that_is_not_a_socket_or_not_in_a_private_folder_is_refused_and_kept(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)  # others may enter it
    for path, message in ((precious, f"{precious} exists and is not a socket: refusing to replace it"),
                          (shared / "warm.sock", f"the socket's folder {shared} must be this user's only")):
        done = subprocess.run([str(SWARM), "warm", "--socket", str(path)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and message in " ".join(done.stderr.split()), done.stderr
    assert precious.read_text() == "keep me" and list(shared.iterdir()) == []


def test_the_default_socket_is_in_a_private_runtime_folder_never_a_shared_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert warm.default_socket() == tmp_path / "run" / "swarmrl" / "warm.sock"
    warm.claim(warm.default_socket())
    assert (tmp_path / "run" / "swarmrl").stat().st_mode & 0o777 == 0o700
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("SWARMRL_STATE", str(tmp_path / "state" / "clients"))
    assert warm.default_socket() == tmp_path / "state" / "run" / "warm.sock"


def _launcher_state() -> None:
    """The launcher's own process state, as a Slurm allocation, `taskset`, `ulimit`, `nice` and `umask` set it."""
    os.sched_setaffinity(0, {0})
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    os.nice(3)
    os.umask(0o027)


def test_a_forked_run_takes_on_its_launchers_process_state_and_names_itself_as_its_command(
        warm_process: Warm, tmp_path: Path) -> None:
    before = warm_process.forked_pids()
    proc = _run(tmp_path, warm_process.socket, "--set", "trainer.steps=1000", preexec_fn=_launcher_state)
    try:
        _wait_for(proc, "step 1 ")
        forked = warm_process.forked_since(before)
        status = Path(f"/proc/{forked}/status").read_text()
        assert re.search(r"Cpus_allowed_list:\s+0\n", status) and re.search(r"Umask:\s+0027\n", status), status
        assert re.search(r"Max open files\s+200\s", Path(f"/proc/{forked}/limits").read_text())
        assert int(Path(f"/proc/{forked}/stat").read_text().rsplit(")", 1)[1].split()[16]) == 3  # field 19: nice
        cmdline = Path(f"/proc/{forked}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert cmdline.startswith("swarm run ") and "tiny.yaml" in cmdline, cmdline
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert _gone(forked)
