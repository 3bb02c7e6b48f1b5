"""Gateway throughput and added latency, with the null engine so that only the server is measured.

Starts `swarm serve --model tiny --engine instant` as its own process, then drives it from this one
with a minimal keep-alive HTTP/1.1 client (asyncio streams: cheaper per call than any HTTP library,
so the load generator does not hide the server's cost). Prints calls/s at each concurrency and the
added latency percentiles at concurrency 1.

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

from core.serve.server import free_port

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 4}).encode()


def request_bytes(port: int) -> bytes:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\nAuthorization: Bearer EMPTY\r\n\r\n")
    return head.encode() + BODY


async def connection(port: int, deadline: float, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    req = request_bytes(port)
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        body = await reader.readexactly(length)
        latencies.append(time.perf_counter() - t0)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head + body)
    writer.close()


async def load(port: int, concurrency: int, seconds: float) -> tuple[float, list[float]]:
    latencies: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(*(connection(port, start + seconds, latencies) for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - start), latencies


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
        asyncio.run(load(port, 4, 1.0))  # warm-up
        rows = []
        for c in (1, 8, 32):
            rate, lat = asyncio.run(load(port, c, args.seconds))
            q = statistics.quantiles(sorted(lat), n=100)
            rows.append((c, rate, q[49] * 1000, q[98] * 1000))
        print(f"{'concurrency':>11} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
        for c, rate, p50, p99 in rows:
            print(f"{c:>11} {rate:>9.0f} {p50:>8.2f} {p99:>8.2f}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
