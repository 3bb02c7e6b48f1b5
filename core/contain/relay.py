"""The relay inside a contained client's network namespace: loopback TCP in, the forwarder's Unix socket out.

Under bubblewrap a contained process gets a network namespace of its own (`core.contain.contained`), where
only the loopback interface exists. Its swarm server URL then names `127.0.0.1:<port>` inside it, and this
relay, started by the sandbox before the command itself, listens there and passes every connection's bytes
to the forwarder's Unix socket (`core.contain.forwarder`), bound into the sandbox. The relay then runs the
command as its child and ends with its exit status (or dies of its signal).

It runs inside the sandbox, next to the code it serves, so it is trusted with nothing: it checks no route
(the forwarder outside does) and holds no secret. Deliberately standard library only and run by its file
path with `python -I`: it imports nothing from the project (`core` need not be importable in there).
It ignores SIGTERM, SIGINT and SIGHUP (by a no-op handler, which exec resets, so the command still gets
them): a drain signals the whole group, and the command must keep its network while it drains.

    python -I relay.py --socket /path/forward.sock --port 8000 -- ARGV...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

LISTEN_HOST = "127.0.0.1"  # the namespace's loopback: nothing outside the sandbox can connect to it
CHUNK = 1 << 16  # bytes per read: an SSE token stream or a JSON body passes in a few
BACKLOG = 128  # pending connections: a client's concurrency times its HTTP pools, with room
# The forwarder starts beside the command, just after it (`contain.popen_contained`): on a loaded machine its
# socket can come up seconds after the command's first request. Until the relay has reached it once, a
# connection waits this long for it rather than being closed (a client would see a broken pipe).
FORWARDER_START_S = 60.0
RETRY_S = 0.05


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close the other side so it sees the end of the request or response."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


_reached = asyncio.Event()  # the forwarder answered once: from then on a failed connect means it is gone


async def _upstream(socket_path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FORWARDER_START_S
    while True:
        try:
            pair = await asyncio.open_unix_connection(socket_path)
        except OSError:
            if _reached.is_set() or loop.time() >= deadline:
                raise
            await asyncio.sleep(RETRY_S)
            continue
        _reached.set()
        return pair


async def _serve(socket_path: str, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        up_r, up_w = await _upstream(socket_path)
    except OSError:  # the forwarder is gone (or never came up): the client sees a closed connection and retries
        client_w.close()
        return
    try:
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
    finally:
        for w in (client_w, up_w):
            w.close()


async def _main(socket_path: str, port: int, argv: list[str]) -> int:
    server = await asyncio.start_server(lambda r, w: _serve(socket_path, r, w), LISTEN_HOST, port, backlog=BACKLOG)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda: None)  # the command gets them too (module docstring)
    async with server:
        child = await asyncio.create_subprocess_exec(*argv)
        return await child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the forwarder's Unix socket")
    parser.add_argument("--port", type=int, required=True, help="the loopback port the command's server URL names")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        parser.error("no command given after --")
    try:
        code = asyncio.run(_main(args.socket, args.port, argv))
    except OSError as e:  # the port is taken (by nothing else in a fresh namespace) or the command is missing
        print(f"swarm relay: {e}", file=sys.stderr, flush=True)
        sys.exit(127)
    if code < 0:  # die of the command's signal, as its starter would have seen the command die
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
