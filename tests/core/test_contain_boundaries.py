"""Each boundary of containment attacked with real processes: `swarm contain` running hostile code.

The network: without a server its command has no network at all; with one (`--server`) it reaches that
server's episode routes and nothing else (not the admin routes, not another local port such as MLflow's).
The files: a sibling run's admin token and server file, a study's state (`--hide`) and the warm socket are
masked, while the working folder inside a masked folder stays writable. The size: a flood of the private
/tmp or HOME ends on a full disk, not in the machine's memory. A hostile sandbox `entry` is invalid.
"""

from __future__ import annotations

import ctypes
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.contain import contained as contain, forwarder, memory_cgroup, namespaces
from core.clients.sandbox import load_agent
from core.sandbox.folder import sandbox_meta
from core.config_io import ConfigError
from core.contain.process_count import remove_cgroup

ROOT = Path(__file__).resolve().parents[2]
needs_bwrap = pytest.mark.skipif(contain.bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


def _contain(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "core.run.cli", "contain", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _python(code: str) -> list[str]:
    return ["--", sys.executable, "-c", code]


@pytest.fixture
def listening() -> Iterator[int]:
    """A real TCP socket listening on the host's loopback (MLflow's port, Ray's, anything local)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A stand-in swarm server: answers every request 200 and records its method and path."""

    seen: list[str] = []

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = json.dumps({"path": self.path, "host": self.headers["host"]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    _Recorder.seen = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", _Recorder.seen
    finally:
        httpd.shutdown()


CONNECT = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
    print("connected")
except OSError as e:
    print("refused:", type(e).__name__)
"""


@needs_bwrap
def test_started_with_no_server_its_command_has_no_network_at_all(tmp_path, listening):
    done = _contain("--", sys.executable, "-c", CONNECT, str(listening), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused: ConnectionRefusedError", done.stdout  # nothing listens in its namespace


CALLS = """
import json, sys, urllib.request, urllib.error
url = sys.argv[1]
def call(method, path):
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, method=method, data=b"{}" if method != "GET" else None,
                                                           headers={"content-type": "application/json"}), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
print(json.dumps({p: call(m, p) for m, p in [
    ("POST", "/swarm/v1/episodes"), ("POST", "/swarm/v1/episodes/ep-1/finish"), ("POST", "/episodes/s3cr3t/v1/chat/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/swarm/v1/clients"), ("GET", "/swarm/v1/status"),
    ("POST", "/swarm/v1/admin/shutdown"), ("POST", "/swarm/v1/admin/pause"), ("POST", "/swarm/v1/episodes/..%2Fadmin/finish"),
    ("GET", "/api/2.0/mlflow/experiments/search"), ("POST", "/episodes/x/v1/../../swarm/v1/admin/drain")]}))
"""


@needs_bwrap
def test_with_a_server_it_reaches_only_that_servers_episode_routes_and_no_other_port(tmp_path, server, listening):
    url, seen = server
    done = _contain("--server", url, "--", sys.executable, "-c", CALLS, url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    episode_routes = ["/swarm/v1/episodes", "/swarm/v1/episodes/ep-1/finish", "/episodes/s3cr3t/v1/chat/completions",
                      "/v1/chat/completions", "/swarm/v1/clients", "/swarm/v1/status"]
    for path in episode_routes:
        assert answers[path][0] == 200 and answers[path][1]["path"] == path, answers
    refused = [p for p in answers if p not in episode_routes]
    for path in refused:
        status, body = answers[path]
        assert status == 403 and body["error"]["code"] == "route_not_forwarded", (path, answers[path])
    assert sorted(seen) == sorted(f"{'GET' if p.endswith('status') else 'POST'} {p}" for p in episode_routes)
    # The server built its answer for the URL the command used: the same port on the sandbox's own loopback.
    assert answers["/swarm/v1/status"][1]["host"] == url.removeprefix("http://")
    other = _contain("--server", url, "--", sys.executable, "-c", CONNECT, str(listening), cwd=tmp_path)
    assert other.stdout.strip() == "refused: ConnectionRefusedError", other.stdout


def test_the_forwarders_route_check_refuses_what_no_episode_route_is():
    assert forwarder.allowed("POST", "/episodes/abc_-1/v1/chat/completions")
    assert forwarder.allowed("DELETE", "/swarm/v1/clients/letters-host-ab12-77")
    for method, path in [("POST", "/swarm/v1/admin/checkpoint"), ("GET", "/swarm/v1/episodes"),
                         ("POST", "/swarm/v1/episodes/%2e%2e/finish"), ("POST", "/swarm/v1/episodes/../finish"),
                         ("DELETE", "/swarm/v1/clients/.."), ("POST", "/v1/embeddings"), ("CONNECT", "/v1/models")]:
        assert not forwarder.allowed(method, path), (method, path)
    with pytest.raises(forwarder.Refused, match="chunked requests are not forwarded"):
        forwarder.parse_head(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    method, target, headers, length = forwarder.parse_head(
        b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: h\r\nX-Forwarded-Proto: https\r\nConnection: keep-alive\r\n"
        b"Content-Length: 2\r\n\r\n")
    assert (method, target, length) == ("POST", "/v1/completions?x=1", 2)
    assert [k.lower() for k, _ in headers] == ["host", "content-length"]  # what could fool the server is dropped


READ = """
import json, socket, sys
from pathlib import Path
seen = {}
for p in sys.argv[1:]:
    try:
        if p.endswith(".sock"):
            socket.socket(socket.AF_UNIX).connect(p)
            seen[p] = "connected"
        else:
            seen[p] = Path(p).read_text()
    except OSError as e:
        seen[p] = type(e).__name__
try:
    Path("own/work.txt").write_text("mine")
    seen["wrote"] = "yes"
except OSError as e:
    seen["wrote"] = type(e).__name__
print(json.dumps(seen))
"""


@needs_bwrap
@pytest.mark.parametrize("named_by", ["--hide", "SWARMRL_CONTAIN_HIDE"])
def test_a_sibling_runs_token_and_server_file_a_hidden_study_state_and_the_warm_socket_are_unreadable(tmp_path,
                                                                                                      named_by):
    state = tmp_path / "state"
    sibling = tmp_path / "elsewhere" / "sibling-run"
    sibling.mkdir(parents=True)
    (sibling / "admin_token").write_text("the-siblings-admin-token")
    (sibling / "server.json").write_text(json.dumps({"url": "http://127.0.0.1:4242"}))
    (state / "servers").mkdir(parents=True)  # the index entry `swarm run` leaves for the sibling
    (state / "servers" / "4242.json").write_text(json.dumps({
        "url": "http://127.0.0.1:4242", "admin_token_file": str(state / "servers" / "4242.token"),
        "run_folder": str(sibling)}))
    study = tmp_path / "study"
    (study / "own").mkdir(parents=True)
    (study / "state.sqlite").write_text("the study's decisions")
    warm_folder = tmp_path / "warm"
    warm_folder.mkdir(mode=0o700)
    targets = [str(sibling / "admin_token"), str(sibling / "server.json"), str(study / "state.sqlite"),
               str(warm_folder / "warm.sock")]
    with socket.socket(socket.AF_UNIX) as warm_sock:
        warm_sock.bind(targets[-1])
        hide = ["--hide", str(study)] if named_by == "--hide" else []  # else the study's launcher set the variable
        done = _contain(*hide, "--writable", str(study / "own"), "--cwd", str(study), "--",
                        sys.executable, "-c", READ, *targets, cwd=tmp_path,
                        env={"SWARMRL_STATE": str(state), "SWARMRL_WARM": targets[-1],
                             **({} if hide else {"SWARMRL_CONTAIN_HIDE": f"/nonexistent{os.pathsep}{study}"})})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen[targets[0]] in ("", "PermissionError") and seen[targets[1]] in ("", "PermissionError"), seen
    assert seen[targets[2]] == "FileNotFoundError", seen  # inside a hidden folder: an empty one
    assert seen[targets[3]] == "FileNotFoundError", seen  # the warm socket's folder is masked
    assert seen["wrote"] == "yes" and (study / "own" / "work.txt").read_text() == "mine"  # its own folder stays


FLOOD = """
import os, sys
where = sys.argv[1] or os.environ["TMPDIR"]
for i in range(3):
    try:
        with open(os.path.join(where, f"flood-{i}"), "wb") as f:
            for _ in range(30):
                f.write(b"x" * (1 << 20))
        print("wrote", i, flush=True)
    except OSError as e:
        print("stopped:", e.strerror, flush=True)
        sys.exit(3)
"""


@needs_bwrap
@pytest.mark.parametrize("where", ["/tmp", ""], ids=["private-tmp", "home-tmpdir"])
def test_a_flood_of_the_private_tmp_or_home_ends_on_a_full_disk_not_in_memory(tmp_path, where):
    # Each file (30 MiB) is under the file-size limit; three are over the 50 MiB the tmpfs holds.
    done = _contain("--file-size", str(50 << 20), "--", sys.executable, "-c", FLOOD, where, cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["wrote 0", "stopped: No space left on device"], done.stdout


@pytest.mark.parametrize("entry, why", [
    ('"../outside.py"', "it must be a relative path inside the sandbox folder"),
    ('"/etc/passwd"', "it must be a relative path inside the sandbox folder"),
    ("3", "it must be a relative path to a .py file"),
    ('"data.txt"', "is not a Python file that can be imported"),
    ('"link.py"', "outside the sandbox folder"),
])
def test_a_hostile_entry_is_invalid_with_a_clear_error_never_a_crash(tmp_path, entry, why):
    folder = tmp_path / "hostile"
    folder.mkdir()
    (tmp_path / "outside.py").write_text("raise SystemExit('ran code outside the sandbox')\n")
    (folder / "agent.py").write_text("def tasks(split):\n    yield {}\nasync def rollout(task, llm):\n    return 1.0\n")
    (folder / "data.txt").write_text("not python")
    (folder / "link.py").symlink_to(tmp_path / "outside.py")
    (folder / "sandbox.toml").write_text(f"name = 'hostile'\nentry = {entry}\n")
    with pytest.raises(ValueError, match=why):
        load_agent(str(folder))
    if why != "is not a Python file that can be imported":  # refused on reading sandbox.toml, before any import
        with pytest.raises(ValueError, match=why):
            sandbox_meta(folder)


LATE_CLIENT = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30) as s:
    s.sendall(b"ping")
    print(s.recv(16).decode())
"""


def test_the_relay_holds_a_first_request_until_a_forwarder_that_starts_late_is_up(tmp_path):
    # The forwarder starts just after the contained command; on a loaded machine (CI) the command's first
    # request once found no socket yet and got a broken pipe. The relay now waits for the forwarder's socket.
    sock = tmp_path / "forward.sock"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    relay = subprocess.Popen([sys.executable, "-I", str(contain.RELAY), "--socket", str(sock), "--port", str(port),
                              "--", sys.executable, "-c", LATE_CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        threading.Event().wait(1.5)  # the request is in the relay by now, with no forwarder to take it
        with socket.socket(socket.AF_UNIX) as late:
            late.bind(str(sock))
            late.listen()
            late.settimeout(30)  # an old relay closed the request instead: nothing would ever connect
            conn, _ = late.accept()
            with conn:
                assert conn.recv(16) == b"ping"
                conn.sendall(b"pong")
        out, _ = relay.communicate(timeout=60)
    finally:
        relay.kill()
    assert relay.returncode == 0 and out.strip() == "pong", out


KERNEL_SETTINGS = """
import os
path = "/proc/sys/kernel/core_pattern"
print("uid", os.getuid())
print("writable" if os.access(path, os.W_OK) else "read-only")
try:
    with open(path, "w") as fh:  # a no-op write: the value it already has
        fh.write(open(path).read())
    print("wrote")
except OSError as e:
    print("refused:", e.strerror)
"""


@needs_bwrap
def test_contained_code_is_no_root_and_cannot_write_kernel_settings(tmp_path):
    # As root (the study's and CI's uid on these machines), a sandbox without a user namespace was uid 0 and
    # /proc/sys stayed writable: a core_pattern of `|/writable/x` runs x as full root on the next crash.
    done = _contain("--required", "--", sys.executable, "-c", KERNEL_SETTINGS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    uid, access, write = done.stdout.splitlines()
    assert uid == f"uid {namespaces.SANDBOX_ID}" and access == "read-only", done.stdout
    assert write == "refused: Read-only file system", done.stdout
    shell = _contain("--required", "--", "sh", "-c", "test -w /proc/sys/kernel/core_pattern", cwd=tmp_path)
    assert shell.returncode == 1, shell.stdout + shell.stderr


def test_required_containment_refuses_where_the_kernel_refuses_a_user_namespace(monkeypatch):
    # Where `bwrap --unshare-user` fails, the sandbox could only be root: `required` says so and why.
    monkeypatch.setattr(contain, "bwrap", lambda: "/usr/bin/bwrap")
    monkeypatch.setattr(contain, "user_namespace_refusal", lambda exe: "setting up uid map: Permission denied")
    with pytest.raises(ConfigError, match="user namespace.*setting up uid map: Permission denied"):
        contain.require_bwrap("required", "containment.clients")
    contain.require_bwrap("auto", "containment.clients")  # auto runs without one, said once


SHM_FLOOD = """
import os, sys
for where in ("/dev/shm", "/dev"):
    written = 0
    try:
        for i in range(5):  # 5 files of 60 MiB, each under the 64 MiB file-size limit: 300 MiB in all
            with open(os.path.join(where, f"flood-{i}"), "wb") as f:
                for _ in range(60):
                    f.write(b"x" * (1 << 20))
                    written += 1
        print(where, "took", written, "MiB")
    except OSError as e:
        print(where, "stopped after", written, "MiB:", e.strerror)
"""


@needs_bwrap
def test_a_300_mib_write_to_dev_shm_or_dev_ends_at_the_tmp_bound(tmp_path):
    # /dev and /dev/shm were unbounded tmpfs: 240 MiB each went past a 64 MiB file-size and /tmp bound.
    done = _contain("--file-size", str(64 << 20), "--", sys.executable, "-c", SHM_FLOOD, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    shm, dev = done.stdout.splitlines()
    assert shm.startswith("/dev/shm stopped after") and shm.endswith("No space left on device"), shm
    assert int(shm.split()[3]) <= 64, shm
    assert dev == "/dev stopped after 0 MiB: Read-only file system", dev


SYSV_SHM = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for _ in range(3):
    shmid = libc.shmget(0, int(sys.argv[1]), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600: kept until removed
    print("segment", shmid, flush=True)
"""


def _segments_of_size(size: int) -> list[int]:
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [int(r.split()[1]) for r in rows if int(r.split()[3]) == size]


@needs_bwrap
def test_sysv_shared_memory_made_inside_does_not_outlive_the_sandbox(tmp_path):
    size = (64 << 20) + 4096 * 7  # a size nothing else on the machine asks for, to find its segments by
    done = _contain("--", sys.executable, "-c", SYSV_SHM, str(size), cwd=tmp_path)
    left = _segments_of_size(size)
    libc = ctypes.CDLL(None, use_errno=True)
    for shmid in left:  # IPC_RMID: an old sandbox left them on the host
        libc.shmctl(shmid, 0, None)
    assert done.returncode == 0 and done.stdout.count("segment") == 3, done.stdout + done.stderr
    assert all(int(line.split()[1]) >= 0 for line in done.stdout.splitlines()), done.stdout
    assert left == [], f"{len(left)} segments outlived the sandbox"


HOLDERS = """
import subprocess, sys, time
until = time.time() + 8
child = "import sys, time; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096]); time.sleep(max(0.0, float(sys.argv[2]) - time.time())); print('held', flush=True)"
kids = [subprocess.Popen([sys.executable, "-c", child, str(120 << 20), str(until)]) for _ in range(5)]
for kid in kids:
    kid.wait()
"""


def _no_memory_cgroup() -> str:
    """Why this machine gives this user no memory cgroup, or "" where it does (the probe's group removed)."""
    group, why = memory_cgroup.memory_cgroup(64 << 20)
    remove_cgroup(group)
    return why


NO_MEMORY_CGROUP = _no_memory_cgroup()


@needs_bwrap
@pytest.mark.skipif(bool(NO_MEMORY_CGROUP), reason=f"the kernel gives this user no memory cgroup: {NO_MEMORY_CGROUP}")
def test_the_total_memory_cap_holds_for_several_children_together(tmp_path):
    # RLIMIT_AS is per process: 6 children held 1224 MiB under a 300 MiB limit each. Five children of 120 MiB,
    # all alive at once when each says "held", fit 300 MiB only two at a time.
    done = _contain("--memory", str(300 << 20), "--address-space", str(1 << 30), "--", sys.executable, "-c", HOLDERS,
                    cwd=tmp_path)
    held = done.stdout.split().count("held")
    assert 1 <= held <= 2, done.stdout + done.stderr


SOCKETS = """
import os, sys, urllib.request
urllib.request.urlopen(sys.argv[2] + "/swarm/v1/status", timeout=60).read()  # its own forwarder is up by now
found = []
for folder, _, files in os.walk(sys.argv[1]):
    found += [os.path.join(folder, f) for f in files if f.endswith(".sock")]
print(len(found))
"""


@needs_bwrap
def test_with_tmpdir_outside_tmp_a_sibling_sandboxs_forwarder_socket_stays_invisible(tmp_path, server):
    # Under Slurm TMPDIR is often outside /tmp, where the private /tmp hid nothing: every sandbox saw every
    # other's forwarder socket, and opened episodes on a sibling run's server through it.
    url, _ = server
    tmpdir = Path(tempfile.mkdtemp(prefix="swarmrl-test-tmpdir-", dir="/var/tmp"))
    env = {"TMPDIR": str(tmpdir)}
    sibling = subprocess.Popen([sys.executable, "-m", "core.run.cli", "contain", "--server", url, "--", sys.executable,
                                "-c", "import time; time.sleep(60)"], cwd=tmp_path, env={**os.environ,
                                "PYTHONPATH": str(ROOT), **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list(tmpdir.rglob("forward.sock")) and time.monotonic() < deadline and sibling.poll() is None:
            time.sleep(0.1)
        assert len(list(tmpdir.rglob("forward.sock"))) == 1, "the sibling's forwarder never came up"
        done = _contain("--server", url, "--", sys.executable, "-c", SOCKETS, str(tmpdir), url, cwd=tmp_path, env=env)
    finally:
        sibling.terminate()
        sibling.wait(timeout=60)
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1", done.stdout  # its own socket, and not the sibling's


class _CountingServer(http.server.ThreadingHTTPServer):
    """The stand-in swarm server, counting the connections it holds open now and at most (its descriptors)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.lock, self.live, self.peak = threading.Lock(), 0, 0

    def process_request_thread(self, request, client_address) -> None:
        with self.lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.live -= 1

    def handle_error(self, request, client_address) -> None:
        pass  # a connection the forwarder closed mid-request: expected here


def _forwarder(sock: Path, url: str, *options: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-I", str(contain.FORWARDER), "--socket", str(sock), "--upstream", url,
                             *options], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


HALF = b"POST /swarm/v1/episodes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
WHOLE = b"POST /swarm/v1/episodes HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


def _honest_call(sock: Path) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(sock))
        s.sendall(WHOLE)
        return s.recv(64)


def test_a_half_open_flood_leaves_an_honest_client_working_and_the_servers_descriptors_bounded(tmp_path):
    # Requests that sent their head and one byte of body, then closed, held a server connection for good (no body
    # or response timeout, the close not passed on): 1350 took all 1024 of the server's descriptors.
    httpd = _CountingServer()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    flooded, honest = tmp_path / "flooded.sock", tmp_path / "honest.sock"
    attacked = _forwarder(flooded, url, "--max-connections", "32", "--body-idle-s", "2")
    clean = _forwarder(honest, url)
    held: list[socket.socket] = []
    try:
        for i in range(150):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(flooded))
            s.sendall(HALF)
            if i % 2:
                s.close()  # abandoned: its server connection must close with it
            else:
                held.append(s)  # half-open: held until the body timeout
        answers = [_honest_call(honest) for _ in range(5)]  # another sandbox's client, during the flood
        time.sleep(1.0)
        during = httpd.live
        refused = 0
        for s in held:
            s.settimeout(0.2)  # a 503 is there at once; a request within the cap is still waiting for its body
            try:
                refused += s.recv(64).startswith(b"HTTP/1.1 503")
            except OSError:
                pass
        deadline = time.monotonic() + 15
        while httpd.live and time.monotonic() < deadline:
            time.sleep(0.1)
        after = httpd.live
    finally:
        for s in held:
            s.close()
        for proc in (attacked, clean):
            proc.kill()
            proc.wait(timeout=30)
        httpd.shutdown()
    assert all(a.startswith(b"HTTP/1.0 200") or a.startswith(b"HTTP/1.1 200") for a in answers), answers
    assert httpd.peak <= 32 + 1, f"the server held {httpd.peak} connections at once"  # the cap, and the honest one
    assert during <= 32 and refused >= 1, (during, refused)  # past the cap: 503
    assert after == 0, f"{after} server connections outlived their stalled clients"
    assert len(attacked.stderr.read()) < 20_000  # its log is rate-limited


def test_a_content_length_of_anything_but_ascii_digits_is_refused():
    for value in ("\u00b2", "1\u00b2", "\u0661\u0662", "+5", "5 5", "0x10", ""):
        with pytest.raises(forwarder.Refused, match="ASCII digits"):
            forwarder.parse_head(f"POST /v1/completions HTTP/1.1\r\nContent-Length: {value}\r\n\r\n".encode("utf-8"))
    with pytest.raises(forwarder.Refused, match="one Content-Length"):  # two lengths: request smuggling
        forwarder.parse_head(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 20\r\n\r\n")


def test_the_forwarders_log_is_rate_limited_and_bounded_in_total(capsys):
    log = forwarder.Log(burst=5, window_s=60, total=12)
    for i in range(1000):
        log.line(f"line {i}", now=float(i // 100) * 60)  # ten windows of 100 lines each
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 12 and lines[:5] == [f"line {i}" for i in range(5)], lines
    assert lines[5] == "swarm forwarder: 95 more line(s) left out in the last 60 s", lines
    assert lines[-1] == "swarm forwarder: 12 lines logged; no more from this forwarder", lines


def test_every_test_docs_security_names_as_its_check_exists():
    # docs/security.md names, line by line, the test that checks each boundary; a renamed or removed test
    # would leave a promise nothing checks.
    named = set(re.findall(r"\b(test_[a-z0-9_]+)\b", (ROOT / "docs" / "security.md").read_text()))
    files = list((ROOT / "tests").rglob("test_*.py"))
    defined = {m for f in files for m in re.findall(r"^def (test_[a-z0-9_]+)", f.read_text(), re.M)}
    assert len(named) > 10 and not named - defined - {f.stem for f in files}, sorted(named - defined)
