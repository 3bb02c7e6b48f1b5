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

It is one process per contained client start (standard library only, run by its file path with `python
-I`, so it starts in milliseconds), and ends when the contained process it serves ends (`--watch-pid`, a
pidfd) or its starter dies. Deliberately not: a general HTTP proxy, TLS termination, or a rate limiter.

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
    headers, length = [], 0
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
            if not value.strip().isdigit() or int(value) > MAX_BODY:
                raise Refused(413, "Content Too Large", f"a body over {MAX_BODY} bytes, or a bad Content-Length",
                              "body_too_large")
            length = int(value)
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


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int | None) -> None:
    """Copy `limit` bytes (None: until EOF) from reader to writer."""
    left = limit
    while left is None or left > 0:
        data = await reader.read(CHUNK if left is None else min(CHUNK, left))
        if not data:
            return
        writer.write(data)
        await writer.drain()
        if left is not None:
            left -= len(data)


class Forwarder:
    """Serves one Unix socket, sending the allowed requests on to `upstream` (module docstring)."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the upstream {upstream!r} is not an http(s) URL")
        self.host, self.tls = parts.hostname, parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.refused = 0  # requests refused so far (logged one line each)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            head = await _read_head(reader)
            method, target, headers, length = parse_head(head)
            up_r, upstream = await asyncio.open_connection(self.host, self.port,
                                                           ssl=ssl.create_default_context() if self.tls else None)
            lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers), "Connection: close", "", ""]
            upstream.write("\r\n".join(lines).encode("latin-1"))
            await _copy(reader, upstream, length)
            await _copy(up_r, writer, None)
        except Refused as e:
            self.refused += 1
            print(f"swarm forwarder: refused: {e}", file=sys.stderr, flush=True)
            writer.write(e.response)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError):
            pass  # the client went away, or the server is down: the client sees a closed connection and retries
        finally:
            for w in (writer, upstream):
                if w is not None:
                    try:
                        await w.drain()
                    except (ConnectionError, OSError):
                        pass
                    w.close()


async def serve(socket_path: Path, upstream: str, watch_pid: int | None) -> None:
    """Serve until process `watch_pid` ends (or forever when None), then remove the socket."""
    forwarder = Forwarder(upstream)
    loop = asyncio.get_running_loop()
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
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.socket, args.upstream, args.watch_pid))
    except (OSError, ValueError) as e:
        print(f"swarm forwarder: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
