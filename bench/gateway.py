"""Gateway throughput and added latency, with the null engine so that only the server is measured.

Starts `swarm serve --model tiny --engine instant` as its own process, then drives it from this one
with a minimal keep-alive HTTP/1.1 client (asyncio streams: cheaper per call than any HTTP library,
so the load generator does not hide the server's cost). Prints:

1. chat calls/s at each concurrency and the added latency percentiles;
2. `/v1/models` latency alone and while near-limit bodies (a 7.8 MiB chat body, a ~3.9M-id
   completions prompt) are posted back to back: with parsing on the event loop it waited for each
   parse (1.4 s); off the loop it should stay within tens of ms (the ratio is the figure);
3. the streaming bookkeeping's cost per token at 4k and 64k tokens (flat when O(1) per token);
4. last line: calls/s per API (Chat Completions, Completions, Responses, Messages) at concurrency 8,
   the median of interleaved one-second rounds, each with its ratio to Chat Completions.

    .venv/bin/python bench/gateway.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from core.models import byte_tokenizer
from core.serve.server import free_port
from core.serve.streaming import IncrementalText, _Held

QUESTION = "What is 2 + 3?"
BODIES = {  # one small agent call per API, the same question and budget
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": QUESTION, "max_tokens": 4}),
    "responses": ("/v1/responses", {"model": "tiny", "input": QUESTION, "max_output_tokens": 4}),
    "messages": ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}),
}
NEAR_LIMIT = int(7.8 * 2**20)  # bytes: just under server.max_request_bytes (8 MiB)


def request_bytes(port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nAuthorization: Bearer EMPTY\r\n\r\n")
    return head.encode() + data


async def roundtrip(reader, writer, req: bytes) -> bytes:
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return head


async def connection(port: int, req: bytes, deadline: float, latencies: list[float], ok: bytes = b"HTTP/1.1 200") -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        head = await roundtrip(reader, writer, req)
        latencies.append(time.perf_counter() - t0)
        if not head.startswith(ok):
            raise RuntimeError(head)
    writer.close()


async def load(port: int, concurrency: int, seconds: float, api: str = "chat") -> tuple[float, list[float]]:
    latencies: list[float] = []
    req = request_bytes(port, *BODIES[api])
    start = time.perf_counter()
    await asyncio.gather(*(connection(port, req, start + seconds, latencies) for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - start), latencies


async def models_latency(port: int, seconds: float, big: bytes | None) -> tuple[list[float], int]:
    """GET /v1/models latencies for `seconds`, while `big` (if any) is posted back to back; and how many were."""
    models = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    latencies: list[float] = []
    posted = [0]
    deadline = time.perf_counter() + seconds

    async def hammer():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < deadline:
            await roundtrip(reader, writer, big)  # a 400 (too long for the context) once parsed and checked
            posted[0] += 1
        writer.close()

    async def probe():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            await roundtrip(reader, writer, models)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        writer.close()

    await asyncio.gather(probe(), *([hammer()] if big is not None else []))
    return latencies, posted[0]


def near_limit_bodies(port: int) -> dict[str, bytes]:
    text = "x " * ((NEAR_LIMIT - 200) // 2)
    ids = ",".join(["1"] * ((NEAR_LIMIT - 200) // 2))
    chat = request_bytes(port, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]})
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n")
    data = ('{"model": "tiny", "max_tokens": 1, "prompt": [' + ids + "]}").encode()
    complete = (head + f"Content-Length: {len(data)}\r\nAuthorization: Bearer EMPTY\r\n\r\n").encode() + data
    return {"chat 7.8 MiB text": chat, f"completions {(len(ids) + 1) // 2 / 1e6:.1f}M ids": complete}


def stream_bookkeeping_us(tokens: int) -> float:
    """Microseconds per token of a streamed completion's bookkeeping (incremental decode, stop-string
    hold-back with two stop strings), as `chat_events` does it per token: flat in the length if O(1)."""
    tok = byte_tokenizer()
    ids = tok(("the sum is 5. " * (tokens // 14 + 1)), add_special_tokens=False)["input_ids"][:tokens]
    text, held = IncrementalText(lambda w: tok.decode(w, skip_special_tokens=False)), _Held(5, 5)
    start = time.perf_counter()
    for t in ids:
        held.take(text.add(t), ["</end>", "STOP!"])
    return (time.perf_counter() - start) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "core.run.cli", "serve", "--model", "tiny", "--engine", "instant",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        for api in BODIES:
            asyncio.run(load(port, 4, 0.5, api))  # warm-up, and each API answers 200
        rows = []
        for c in (1, 8, 32):
            rate, lat = asyncio.run(load(port, c, args.seconds))
            q = statistics.quantiles(sorted(lat), n=100)
            rows.append((c, rate, q[49] * 1000, q[98] * 1000))
        print(f"{'concurrency':>11} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
        for c, rate, p50, p99 in rows:
            print(f"{c:>11} {rate:>9.0f} {p50:>8.2f} {p99:>8.2f}")

        print("\nstreaming bookkeeping per token: " + ", ".join(
            f"{n // 1024}k tokens {stream_bookkeeping_us(n):.1f} us" for n in (4096, 65536)))

        idle, _ = asyncio.run(models_latency(port, 2.0, None))
        print(f"\n{'/v1/models while':<28} {'p50 ms':>8} {'max ms':>8} {'max/idle p50':>13} {'big bodies':>10}")
        print(f"{'idle':<28} {statistics.median(idle) * 1000:>8.2f} {max(idle) * 1000:>8.2f} {'':>13} {0:>10}")
        for name, big in near_limit_bodies(port).items():
            lat, posted = asyncio.run(models_latency(port, args.seconds, big))
            print(f"{name:<28} {statistics.median(lat) * 1000:>8.2f} {max(lat) * 1000:>8.2f} "
                  f"{max(lat) / statistics.median(idle):>12.0f}x {posted:>10}")

        # Interleaved one-second rounds, median per API: a load change on the machine hits every API alike.
        runs: dict[str, list[float]] = {api: [] for api in BODIES}
        for _ in range(max(3, round(args.seconds))):
            for api in BODIES:
                runs[api].append(asyncio.run(load(port, 8, 1.0, api))[0])
        rates = {api: statistics.median(r) for api, r in runs.items()}
        chat = rates["chat"]
        print("\ncalls/s per API (null engine, concurrency 8): "
              + ", ".join(f"{api} {rate:.0f} ({rate / chat:.2f}x chat)" for api, rate in rates.items()))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
