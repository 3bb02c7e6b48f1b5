"""The forwarder: the one way out of a contained client's network namespace, to its swarm server's episode routes.

A contained client under bubblewrap has a network namespace of its own (`core.contain.contained`): no
interface but loopback, so no MLflow, no Ray, no other port of this machine or any other. Its swarm
traffic crosses a Unix socket that this forwarder serves outside the sandbox (bound into it read-only,
reached through `core.contain.relay` on a loopback port inside). Each HTTP request is read here, its
method and path checked against ROUTES, and only then sent on to the server, as a fresh connection that
closes after the response; the response streams back unchanged (an SSE stream passes token by token).

What passes (ROUTES): the OpenAI routes of an episode (`/episodes/{secret}/v1/...`) and the keyed ones
(`/v1/chat/completions`, `/v1/completions`, `/v1/models`), and the client's own swarm calls: open an
episode, its heartbeat, finish and abort, register (and renew), leave the client table, and read
`/swarm/v1/status` (what any client reads for the group size). Refused with an OpenAI-shaped 403: the
admin routes, any other path, a path with `..`, `%` or other characters no swarm id holds, chunked or
upgraded requests (the SDK sends a Content-Length), and proxy headers that would change what the server
believes about the request (`X-Forwarded-*`, `Forwarded`). The server still checks every key: this
forwarder narrows what can be asked, it does not authorize.

It cannot be turned on the server it guards: a request's head, its body and the server's response each
have a timeout (a request that stalls, or a client that stops reading, loses its server connection); a
client that closes before its response has its server connection closed at once (a request sent half and
abandoned no longer holds one of the server's descriptors); at most `--max-connections` requests are in
flight (503 past it), so one sandbox holds at most that many of the server's connections; `Content-Length`
is ASCII digits, once; what it logs is rate-limited and bounded in total (it runs uncontained, so no
file-size limit would stop a flood of log lines).

It is one process per contained client start (standard library only, run by its file path with `python
-I`, so it starts in milliseconds), and ends when the contained process it serves ends (`--watch-pid`, a
pidfd) or its starter dies. Deliberately not: a general HTTP proxy, TLS termination, or a rate limiter of
requests (the connection cap bounds what is open at once, not how often).

    python -I forwarder.py --socket /run/x/forward.sock --upstream http://127.0.0.1:8000 --watch-pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import ssl
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

# A path segment any swarm id, episode secret or client id is made of (RFC 3986 unreserved characters): no
# `%`, so no encoded `/` or `.` reaches the server's router, and `.`/`..` segments are refused on their own.
_SEG = r"[A-Za-z0-9_~-][A-Za-z0-9._~-]*"
# (method, path) of each route a contained client may call; every other request is refused.
ROUTES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((m, re.compile(p)) for m, p in (
    ("POST", r"/swarm/v1/episodes"),                                      # open an episode
    ("POST", rf"/swarm/v1/episodes/{_SEG}/(?:heartbeat|finish|abort)"),   # its own episode, by its key
    ("POST", r"/swarm/v1/clients"),                                       # register, and renew as a heartbeat
    ("DELETE", rf"/swarm/v1/clients/{_SEG}"),                             # leave the client table, by its key
    ("GET", r"/swarm/v1/status"),                                         # the group size, the served models
    ("POST", rf"/episodes/{_SEG}/v1/(?:chat/completions|completions)"),   # an episode's OpenAI routes
    ("GET", rf"/episodes/{_SEG}/v1/models"),
    ("POST", r"/v1/(?:chat/completions|completions)"),                    # the keyed OpenAI routes
    ("GET", r"/v1/models"),
))
MAX_HEAD = 64 * 1024  # bytes of request line and headers: an SDK request's are well under 2 KiB
# Bodies larger than this are refused: a chat request with a long context is a few MiB at most.
MAX_BODY = 64 * 1024 * 1024
HEAD_TIMEOUT_S = 30.0  # a client that opens a connection and sends no request holds nothing for long
# A body arrives in one burst (the relay copies it from loopback): a pause this long, or a whole body slower
# than BODY_TIMEOUT_S, is a client holding the server's connection open, not one sending a request.
BODY_IDLE_S = 30.0
BODY_TIMEOUT_S = 120.0
# The server answers an episode's completion when the model has generated it: minutes on a loaded engine, and an
# SSE stream may pause as long between tokens. Past this with no byte either way, the request is abandoned.
RESPONSE_IDLE_S = 900.0
CONNECT_TIMEOUT_S = 30.0  # reaching the server on this machine's loopback (or the run's host)
# Requests in flight at once: a client's episodes in flight (`concurrency`, 4 by default) each with a request
# and a heartbeat, many times over. Past it a request gets 503, so one sandbox never holds more of the
# server's descriptors than this (1350 abandoned requests once took all 1024 of them).
MAX_CONNECTIONS = 256
# Log lines: at most LOG_BURST per LOG_WINDOW_S (then one line saying how many were left out), and LOG_TOTAL
# in the forwarder's life: it runs uncontained, and once wrote 7-10 MB of tracebacks a minute out of descriptors.
LOG_BURST = 20
LOG_WINDOW_S = 60.0
LOG_TOTAL = 2000
_DIGITS = re.compile(r"[0-9]{1,19}")  # a Content-Length: ASCII digits only (`str.isdigit` takes `²` too)
CHUNK = 1 << 16
# Hop-by-hop headers and the ones a proxy in front of the server may trust: dropped, then Connection: close.
DROPPED = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer", "upgrade",
           "forwarded", "x-real-ip"}


def allowed(method: str, path: str) -> bool:
    """Whether a contained client may send `method path` (the path without its query) to its server."""
    return any(m == method and pattern.fullmatch(path) for m, pattern in ROUTES)


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class Refused(Exception):
    def __init__(self, status: int, reason: str, message: str, code: str = "route_not_forwarded"):
        super().__init__(message)
        self.response = _refusal(status, reason, message, code)


def parse_head(head: bytes) -> tuple[str, str, list[tuple[str, str]], int]:
    """(method, target, headers to send on, content length) of a request head, or Refused saying why."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise Refused(400, "Bad Request", "not an HTTP/1.1 request line", "bad_request") from None
    if not version.startswith("HTTP/1.") or not target.startswith("/"):
        raise Refused(400, "Bad Request", "only origin-form HTTP/1.x requests are forwarded", "bad_request")
    path = target.split("?", 1)[0]
    if not allowed(method, path):
        raise Refused(403, "Forbidden", f"{method} {path} is not an episode route: a contained client reaches only "
                      "its swarm server's episode, client and OpenAI routes (docs/security.md)")
    headers, length, seen_length = [], 0, False
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        key = name.strip().lower()
        if not sep or not key:
            raise Refused(400, "Bad Request", "a malformed header line", "bad_request")
        if key == "transfer-encoding":
            raise Refused(411, "Length Required", "chunked requests are not forwarded: send a Content-Length",
                          "length_required")
        if key == "content-length":
            digits = value.strip(" \t")
            if seen_length or not _DIGITS.fullmatch(digits):
                raise Refused(400, "Bad Request", "one Content-Length of ASCII digits is forwarded, no other",
                              "bad_request")
            if int(digits) > MAX_BODY:
                raise Refused(413, "Content Too Large", f"a body over {MAX_BODY} bytes", "body_too_large")
            length, seen_length = int(digits), True
        if key in DROPPED or key.startswith("x-forwarded-"):
            continue
        headers.append((name.strip(), value.strip()))
    return method, target, headers, length


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
    except asyncio.LimitOverrunError:
        raise Refused(431, "Request Header Fields Too Large", f"a request head over {MAX_HEAD} bytes",
                      "headers_too_large") from None


class ClientGone(Exception):
    """The client closed (or sent more) before its request was whole or its response was sent."""


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int | None, idle_s: float) -> None:
    """Copy `limit` bytes (None: until EOF) from reader to writer, each read and each drain within `idle_s`.
    An EOF before `limit` bytes is ClientGone (a body sent in part, then abandoned)."""
    left = limit
    while left is None or left > 0:
        data = await asyncio.wait_for(reader.read(CHUNK if left is None else min(CHUNK, left)), idle_s)
        if not data:
            if left is not None:
                raise ClientGone()
            return
        writer.write(data)
        await asyncio.wait_for(writer.drain(), idle_s)  # a peer that stops reading holds nothing for long
        if left is not None:
            left -= len(data)


class Log:
    """Log lines to stderr, rate-limited and bounded in total (LOG_BURST, LOG_WINDOW_S, LOG_TOTAL)."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S, total: int = LOG_TOTAL):
        self.burst, self.window_s, self.total = burst, window_s, total
        self.written = self.in_window = self.dropped = 0
        self.window_start = 0.0

    def line(self, message: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self.window_start >= self.window_s:
            if self.dropped:
                self._write(f"swarm forwarder: {self.dropped} more line(s) left out in the last {self.window_s:.0f} s")
            self.window_start, self.in_window, self.dropped = now, 0, 0
        if self.in_window >= self.burst or self.written >= self.total:
            self.dropped += 1
            return
        self.in_window += 1
        self._write(message[:500])  # one line, never a traceback of pages

    def _write(self, text: str) -> None:
        if self.written == self.total - 1:
            text = f"swarm forwarder: {self.total} lines logged; no more from this forwarder"
        if self.written < self.total:
            self.written += 1
            print(text, file=sys.stderr, flush=True)


class Forwarder:
    """Serves one Unix socket, sending the allowed requests on to `upstream` (module docstring)."""

    def __init__(self, upstream: str, max_connections: int = MAX_CONNECTIONS, body_idle_s: float = BODY_IDLE_S,
                 response_idle_s: float = RESPONSE_IDLE_S, log: Log | None = None):
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the upstream {upstream!r} is not an http(s) URL")
        self.host, self.tls = parts.hostname, parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.max_connections, self.body_idle_s, self.response_idle_s = max_connections, body_idle_s, response_idle_s
        self.log = log or Log()
        self.refused = 0  # requests refused so far
        self.open = 0  # requests in flight

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.max_connections:
            self.refused += 1
            self.log.line(f"swarm forwarder: refused: over {self.max_connections} requests in flight")
            writer.write(_refusal(503, "Service Unavailable", f"over {self.max_connections} requests in flight "
                                  "from this sandbox; retry when some have ended", "too_many_connections"))
            await _close(writer)
            return
        self.open += 1
        upstream: asyncio.StreamWriter | None = None
        try:
            head = await _read_head(reader)
            method, target, headers, length = parse_head(head)
            up_r, upstream = await asyncio.wait_for(asyncio.open_connection(
                self.host, self.port, ssl=ssl.create_default_context() if self.tls else None), CONNECT_TIMEOUT_S)
            lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers), "Connection: close", "", ""]
            upstream.write("\r\n".join(lines).encode("latin-1"))
            async with asyncio.timeout(BODY_TIMEOUT_S):
                await _copy(reader, upstream, length, self.body_idle_s)
            await self._respond(reader, up_r, writer)
        except Refused as e:
            self.refused += 1
            self.log.line(f"swarm forwarder: refused: {e}")
            writer.write(e.response)
        except (asyncio.IncompleteReadError, ClientGone, TimeoutError, ConnectionError, OSError):
            pass  # the client went away or stalled, or the server is down: both connections close, the client retries
        finally:
            self.open -= 1
            for w in (writer, upstream):
                if w is not None:
                    await _close(w)

    async def _respond(self, client_r: asyncio.StreamReader, up_r: asyncio.StreamReader,
                       client_w: asyncio.StreamWriter) -> None:
        """Stream the server's response to the client until the server ends it; a client that closes (or sends
        anything: a request is one per connection) first is ClientGone, and its server connection is closed."""
        copy = asyncio.ensure_future(_copy(up_r, client_w, None, self.response_idle_s))
        gone = asyncio.ensure_future(client_r.read(1))
        try:
            await asyncio.wait({copy, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not copy.done():
                raise ClientGone()
            copy.result()
        finally:
            for task in (copy, gone):
                task.cancel()
            await asyncio.gather(copy, gone, return_exceptions=True)


async def _close(writer: asyncio.StreamWriter) -> None:
    """Flush what is queued (within HEAD_TIMEOUT_S: a peer that reads nothing gets nothing) and close."""
    try:
        await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_S)
    except (ConnectionError, OSError, TimeoutError):
        pass
    writer.close()


async def serve(socket_path: Path, upstream: str, watch_pid: int | None, **options: float) -> None:
    """Serve until process `watch_pid` ends (or forever when None), then remove the socket. `options`: the
    Forwarder's limits (max_connections, body_idle_s, response_idle_s)."""
    forwarder = Forwarder(upstream, **options)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    # asyncio reports its own failures here (an accept out of descriptors, every time it retries): one line
    # each, under the same bound as the rest, never a traceback.
    loop.set_exception_handler(lambda _loop, context: forwarder.log.line(
        f"swarm forwarder: {context.get('message', '')}: {context.get('exception', '')!r}"))
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, done.set)
    if watch_pid is not None:
        try:
            handle = os.pidfd_open(watch_pid)
        except ProcessLookupError:
            return
        loop.add_reader(handle, done.set)
    server = await asyncio.start_unix_server(forwarder.handle, str(socket_path), limit=MAX_HEAD)
    os.chmod(socket_path, 0o600)
    try:
        async with server:
            await done.wait()
    finally:
        socket_path.unlink(missing_ok=True)
        try:
            socket_path.parent.rmdir()  # the folder made for it (`contain.popen_contained`), once empty
        except OSError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path, help="the Unix socket to serve (its folder exists)")
    parser.add_argument("--upstream", required=True, help="the swarm server URL requests go on to")
    parser.add_argument("--watch-pid", type=int, default=None, help="end when this process ends")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, help="requests in flight at once")
    parser.add_argument("--body-idle-s", type=float, default=BODY_IDLE_S, help="longest pause inside a body")
    parser.add_argument("--response-idle-s", type=float, default=RESPONSE_IDLE_S,
                        help="longest wait for the server's next response byte")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.socket, args.upstream, args.watch_pid, max_connections=args.max_connections,
                          body_idle_s=args.body_idle_s, response_idle_s=args.response_idle_s))
    except (OSError, ValueError) as e:
        print(f"swarm forwarder: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
