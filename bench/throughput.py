"""Rollout throughput with 1, 2 and 4 `swarm client` processes against one `swarm serve` server, no training.

    .venv/bin/python bench/throughput.py [--seconds 20] [--clients 1,2,4] [--repeats 2]
                                         [--model smollm2-135m] [--sandbox sandbox:oneword]

One server (`swarm serve --model smollm2-135m`, no trainer) is started once and serves every arm, so
each arm meets the same warm engine. An arm starts N `swarm client` processes (each with the same
`--concurrency`, so N clients keep N times as many episodes in flight), waits until every one of them
has finished an episode and then `--warmup` seconds more, reads `/swarm/v1/status`, waits `--seconds`,
reads it again, and drains its clients (SIGTERM) before the next arm starts. The counts are the
server's, never the clients': episodes finished (`episodes.finished`) and completion tokens served
(`throughput.completion_tokens`), as differences between the two snapshots.

Clients run `--kind eval`: without a trainer, train episodes would fill the buffer and meet
back-pressure, which would measure the buffer, not the rollouts. The sandbox fixes `max_tokens`
(`oneword`: 8), so episodes are short and uniform. With `--repeats 2` the arms run 1,2,4 then
4,2,1 and each arm's rate is its total over both passes, so drift in the machine's load falls
on every arm alike.

Prints one row per arm with the ratios to the first arm and, last,
`throughput: clients=1,2,4 episodes_per_s=... tokens_per_s=...`. It is not a load test of the
gateway (`bench/gateway.py` is) nor of batching alone (`bench/batching.py` is).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from core.run.client_command import ClientSpec  # noqa: E402
from core.serve.server import free_port  # noqa: E402

# One intra-op thread, as the tests pin it: on two shared cores, two OpenMP threads spin-wait on a
# busy core and lose (docs/benchmarks.md, dynamic batching).
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SERVER_START_S = 300.0  # loading smollm2-135m on a busy 2-core machine takes tens of seconds
CLIENT_READY_S = 180.0  # each client's start-up plus its first episode, under load
DRAIN_S = 30.0  # a draining client finishes its open episodes (8 tokens each), then exits
POLL_S = 0.5


def status(url: str) -> dict:
    return httpx.get(url + "/swarm/v1/status", timeout=30).json()


def counts(url: str) -> tuple[int, int, float]:
    """(episodes finished, completion tokens served, when) from one status snapshot."""
    s = status(url)
    return s["episodes"]["finished"], s["throughput"]["completion_tokens"], time.perf_counter()


def start_server(model: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "core.run.cli", "serve", "--model", model, "--port", str(port), "--no-train"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc
        except httpx.HTTPError:
            time.sleep(POLL_S)
    proc.kill()
    raise SystemExit(f"the server did not answer within {SERVER_START_S:.0f} s:\n{log.read_text()[-2000:]}")


class Arm:
    """N client processes, started together, drained together."""

    def __init__(self, n: int, tag: str, args: argparse.Namespace, url: str, logs: Path):
        self.ids = [f"throughput-{tag}-{i}" for i in range(n)]
        self.logs = [logs / f"{cid}.log" for cid in self.ids]
        self.procs = [
            subprocess.Popen(ClientSpec(sys.executable, args.sandbox, url, kind="eval", concurrency=args.concurrency,
                                        client_id=cid).to_argv(),
                             cwd=ROOT, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT)
            for cid, log in zip(self.ids, self.logs)]

    def wait_ready(self, url: str) -> None:
        """Until every client of the arm has finished an episode: started, registered and generating."""
        deadline = time.monotonic() + CLIENT_READY_S
        while time.monotonic() < deadline:
            self.check_alive()
            finished = {c["client_id"]: c["finished"] for c in status(url)["clients"]}
            if all(finished.get(cid, 0) > 0 for cid in self.ids):
                return
            time.sleep(POLL_S)
        self.stop()
        raise SystemExit(f"clients {self.ids} did not all finish an episode within {CLIENT_READY_S:.0f} s")

    def check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                self.stop()
                raise SystemExit(f"a client exited with {proc.returncode} mid-arm:\n{log.read_text()[-2000:]}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # drain: finish what is open, then exit
        deadline = time.monotonic() + DRAIN_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def measure(n: int, tag: str, args: argparse.Namespace, url: str, logs: Path) -> tuple[int, int, float]:
    """One arm: (episodes, tokens, seconds) inside its measuring window."""
    arm = Arm(n, tag, args, url, logs)
    try:
        arm.wait_ready(url)
        time.sleep(args.warmup)
        e0, t0, s0 = counts(url)
        time.sleep(args.seconds)
        e1, t1, s1 = counts(url)
        arm.check_alive()  # a client that died inside the window would have skewed it
    finally:
        arm.stop()
    return e1 - e0, t1 - t0, s1 - s0


def table(arms: list[int], totals: dict[int, list[float]], args: argparse.Namespace) -> list[str]:
    """The rows, then the last line; rates are each arm's totals over all its passes."""
    rates = {n: (e / s, t / s) for n, (e, t, s) in totals.items()}
    base_e, base_t = rates[arms[0]]
    lines = [f"model {args.model}, sandbox {args.sandbox}, {args.concurrency} episodes in flight per client, "
             f"{args.seconds:g} s window x {args.repeats} pass(es), torch threads 1",
             f"{'clients':>7} {'in flight':>9} {'episodes':>8} {'tokens':>7} {'seconds':>7} {'episodes/s':>10} "
             f"{'tokens/s':>8} {'eps ratio':>9} {'tok ratio':>9}"]
    for n in arms:
        e, t, s = totals[n]
        eps, tps = rates[n]
        ratio_e = eps / base_e if base_e else float("nan")
        ratio_t = tps / base_t if base_t else float("nan")
        lines.append(f"{n:>7} {n * args.concurrency:>9} {int(e):>8} {int(t):>7} {s:>7.1f} {eps:>10.2f} {tps:>8.1f} "
                     f"{ratio_e:>8.2f}x {ratio_t:>8.2f}x")
    lines.append(f"throughput: clients={','.join(map(str, arms))} "
                 f"episodes_per_s={','.join(f'{rates[n][0]:.2f}' for n in arms)} "
                 f"tokens_per_s={','.join(f'{rates[n][1]:.1f}' for n in arms)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sandbox", default="sandbox:oneword", help="a sandbox with a fixed, short max_tokens")
    ap.add_argument("--clients", default="1,2,4", help="client processes per arm, comma-separated")
    ap.add_argument("--concurrency", type=int, default=4, help="episodes in flight per client (the CLI's default)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measuring window per arm and pass")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds after every client's first episode")
    ap.add_argument("--repeats", type=int, default=2, help="passes; every other one runs the arms in reverse")
    args = ap.parse_args()
    arms = [int(c) for c in args.clients.split(",") if c.strip()]
    if not arms or min(arms) < 1 or args.seconds <= 0 or args.repeats < 1 or args.concurrency < 1:
        ap.error("--clients needs positive counts; --seconds, --repeats and --concurrency must be positive")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    totals = {n: [0.0, 0.0, 0.0] for n in arms}
    with tempfile.TemporaryDirectory(prefix="swarm-throughput-") as tmp:
        logs = Path(tmp)
        server = start_server(args.model, port, logs / "server.log")
        try:
            for r in range(args.repeats):
                for n in arms if r % 2 == 0 else arms[::-1]:
                    e, t, s = measure(n, f"{r}-{n}", args, url, logs)
                    print(f"pass {r + 1}: {n} client(s): {e} episodes, {t} tokens in {s:.1f} s", flush=True)
                    for i, v in enumerate((e, t, s)):
                        totals[n][i] += v
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    print("\n".join(table(arms, totals, args)))


if __name__ == "__main__":
    main()
