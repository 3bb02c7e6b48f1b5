"""A study's live core run and the A/B swaps into it, through `swarm swap`, HTTP and MLflow only.

A brief with `run.live: true` keeps one long core run going: launch key `live`, started by the
launcher like any run (its workspace sandboxes as isolated clients at the base commit), so it
outlives a killed study and is adopted on resume. Its run folder holds the core's `server.json`
(URL and admin-token file). A `hot_swap` proposal's commit is checked out into a folder of its own
(`runs/live/swaps/<proposal>/`) and each edited sandbox is swapped in as an A/B with
`swarm swap <folder>/sandboxes/<name> --server <live run folder> --ab --contain <mode>`: the new client
runs proposal code, so it starts contained (`launcher.contain_mode`), and serves beside the old ones
(open episodes split about 50/50), the core records the swap (`ab`, its `to_spec` our
folder; tag `swarmrl.sandbox_swap.<n>`) and drains nobody. We tag the live MLflow run
`swarmrl.swap.<n>` = JSON {step, from_version, to_version, proposal}. `ab_steps` reads both
versions' per-step paired scores (`core.config.ab_metric`: each version's mean over the task and
weights cells both reached, the core's pairing) over the steps after the swap (or after a first
window: the confirmation's) where both logged, and says why when the window did not fill (the caller's watch of the live run, or a
timeout); `drain` ends the A/B with `swarm swap <sandbox> --drain-version <loser>` (idempotent: a
version with no clients left is nothing to do). `before` reads the old version's steps up to the
swap (`reward/<sandbox>/version/<v>`, no pairs exist before it): a picture for the report, never evidence.

Intent before act: `.study/swaps/<proposal>.json` is written (fsynced) before `swarm swap` starts,
and its pid right after. On resume after a kill -9, `swap` finds the intent, waits for a `swarm
swap` still running, then asks the live server (its swap records, else the run's
`swarmrl.sandbox_swap.*` tags) whether an A/B to our folder started. If it did, it is recorded and
not repeated; if not, `swarm swap --ab` runs again (an orphaned new client serves on beside it).

This module does not decide anything or touch the workspace's history (checkouts are detached worktrees).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

import httpx
from mlflow.tracking import MlflowClient

from core.config import ab_metric
from researcher.evidence.analysis import read_history
from researcher.runs.launcher import Launcher, contain_mode, hide_env, log_tail, write_json
from researcher.records import COST_METRICS, Cost, SwapSide
from researcher.code.workspace import Workspace

LIVE_KEY = "live"  # the live run's launch key: runs/live/ holds its checkout, checkpoints and server.json
SWAP_TAG = "swarmrl.swap.{n}"  # on the live MLflow run, one per swap
CORE_SWAP_TAG = "swarmrl.sandbox_swap."  # the core's own record of a swap (core/run/loop.py)
# How long the live run may take to come up (server file written) before a swap gives up: a busy
# machine needs a minute to import torch and load the model.
SERVER_UP_S = 300.0
# `swarm swap` waits for the new client to register (120 s) and the old to drain (90 s): this bounds both.
SWAP_TIMEOUT_S = 600.0
POLL_S = 0.5


class SwapFailed(RuntimeError):
    """`swarm swap` refused or failed; the old code keeps serving. The message is for the report."""


def _swap_running(pid: int, spec: str) -> bool:
    """Whether `pid` is still the `swarm swap` of `spec` (not a reused pid, not the client it started)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"swap" in argv and spec.encode() in argv


def _swap_process(spec: str) -> int | None:
    """A running `swarm swap` of `spec`: one a killed study started but had no time to record."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return next((pid for pid in pids if _swap_running(pid, spec)), None)


class LiveRun:
    def __init__(self, launcher: Launcher, client: MlflowClient, state_dir: Path, workspace: Workspace,
                 swarm: Path | None = None) -> None:
        self.launcher, self.client, self.workspace = launcher, client, workspace
        self.intents = state_dir / "swaps"
        self.swarm = swarm or Path(sys.executable).parent / "swarm"

    @property
    def folder(self) -> Path:
        return self.launcher.run_dir(LIVE_KEY)

    def url(self) -> str | None:
        try:
            return json.loads((self.folder / "server.json").read_text())["url"]
        except (OSError, ValueError, KeyError):
            return None

    def status(self) -> dict | None:
        """The live server's `/swarm/v1/status`, or None when it does not answer."""
        url = self.url()
        try:
            if not url:
                return None
            # Other clients' versions and the swaps are the admin token's to read (core.episodes.credentials).
            token = Path(json.loads((self.folder / "server.json").read_text())["admin_token_file"]).read_text().strip()
            return httpx.get(f"{url}/swarm/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
        except (httpx.HTTPError, ValueError, OSError, KeyError):
            return None

    def wait_up(self, alive: Callable[[], bool], timeout_s: float = SERVER_UP_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.status() is None:
            if not alive() or time.monotonic() > deadline:
                raise SwapFailed(f"the live run's server did not come up (log: {self.folder / 'run.log'}):\n"
                                 f"{log_tail(self.folder / 'run.log', 15)}")
            time.sleep(POLL_S)

    # -- the swap ---------------------------------------------------------------------------------
    def swap(self, proposal_id: str, commit: str, sandboxes: list[str], run_id: str | None) -> list[dict]:
        """Swap each sandbox of `commit` into the live run, once; -> the core's swap records, in order."""
        code = self.folder / "swaps" / proposal_id / "code"
        specs = [str((code / "sandboxes" / name).resolve()) for name in sandboxes]
        path = self.intents / f"{proposal_id}.json"
        intent = json.loads(path.read_text()) if path.is_file() else None
        if intent is None or intent.get("commit") != commit:
            intent = {"proposal_id": proposal_id, "commit": commit, "specs": specs, "started_at": time.time()}
            write_json(path, intent)  # before anything acts: a resume knows a swap may have begun
        records = []
        for spec in specs:
            record = self._settle(intent, spec, run_id)  # an earlier attempt's swap, if it happened
            if record is None:
                self.workspace.checkout(commit, code)  # reuses the worktree an earlier attempt made
                record = self._run_swap(path, intent, spec, run_id)
            records.append(record)
        return records

    def _settle(self, intent: dict, spec: str, run_id: str | None) -> dict | None:
        """Wait for a `swarm swap` of `spec` an earlier attempt left running; -> its record if it swapped."""
        pid = (intent.get("pids") or {}).get(spec) or _swap_process(spec)
        deadline = time.monotonic() + SWAP_TIMEOUT_S
        while pid and _swap_running(pid, spec) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.find(spec, run_id)

    def _run_swap(self, path: Path, intent: dict, spec: str, run_id: str | None) -> dict:
        log_path = path.with_name(f"{intent['proposal_id']}.log")
        # Proposal code: its client runs contained, as in a proposal's own core runs (docs/security.md).
        argv = [str(self.swarm), "swap", spec, "--server", str(self.folder), "--ab", "--contain",
                contain_mode(self.launcher.target.containment)]
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **hide_env(self.launcher.target.hidden)},
                                    start_new_session=True)  # a killed study must not take a half-done swap along
        intent.setdefault("pids", {})[spec] = proc.pid
        write_json(path, intent)
        try:
            code = proc.wait(timeout=SWAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        record = self.find(spec, run_id)
        if record is None:
            raise SwapFailed(f"`swarm swap` exited {code} without swapping; the old code keeps serving:\n"
                             f"{log_tail(log_path, 15)}")
        return record

    def find(self, spec: str, run_id: str | None) -> dict | None:
        """The core's record of the A/B start to `spec`: from the live server, else from the run's tags
        (a later drain naming `spec`'s client as successor is a record too, but not an A/B)."""
        status = self.status()
        records = status.get("swaps", []) if status else []
        if not records and run_id:
            tags = self.client.get_run(run_id).data.tags
            records = [json.loads(v) for k, v in tags.items() if k.startswith(CORE_SWAP_TAG)]
        found = [r for r in records if r.get("to_spec") == spec and r.get("ab")]
        return found[-1] if found else None

    def tag(self, run_id: str, record: dict, proposal_id: str) -> None:
        """`swarmrl.swap.<n>` on the live run (idempotent: the same value again on resume)."""
        value = {"step": record["step"], "from_version": ",".join(record["from_versions"]),
                 "to_version": record["to_version"], "proposal": proposal_id}
        self.client.set_tag(run_id, SWAP_TAG.format(n=record["n"]), json.dumps(value))

    def drain(self, sandbox: str, version: str, proposal_id: str) -> None:
        """End an A/B: the clients of `version` drain, the other version's client their successor."""
        log_path = self.intents / f"{proposal_id}.log"
        argv = [str(self.swarm), "swap", sandbox, "--server", str(self.folder), "--drain-version", version]
        with open(log_path, "ab") as log_file:
            code = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=SWAP_TIMEOUT_S).returncode
        if code != 0:
            raise SwapFailed(f"`swarm swap --drain-version {version}` exited {code}; both versions still serve:\n"
                             f"{log_tail(log_path, 15)}")

    # -- the comparison ---------------------------------------------------------------------------
    def ab_steps(self, run_id: str, record: dict, window: int, stopped: Callable[[], str | None],
                 timeout_s: float, poll_s: float = POLL_S,
                 after: int | None = None) -> tuple[SwapSide, SwapSide, str | None]:
        """(old, new, cut): both versions' per-step paired scores over the first `window` steps after the swap
        (after step `after`, when given: a confirmation's window, which the first never saw) where both logged
        one, waiting for them to be logged; `cut` is None when the window filled, else why it did not: what
        `stopped` said (the live run ended, stalled, diverged or spent the budget), or that `timeout_s` passed."""
        step = max(record["step"] or 0, after or 0)
        new_metric = ab_metric(record["sandbox"], record["to_version"])
        deadline, cut = time.monotonic() + timeout_s, None
        while True:
            old: dict[int, list[float]] = {}
            for version in record["from_versions"]:  # several old clients of different versions: their mean
                for s, v in read_history(self.client, run_id, ab_metric(record["sandbox"], version)):
                    if s > step:
                        old.setdefault(s, []).append(v)
            new = {s: v for s, v in read_history(self.client, run_id, new_metric) if s > step}
            both = sorted(set(old) & set(new))[:window]
            if len(both) >= window:
                break
            cut = stopped() or (f"the A/B's window of {window} steps did not fill within {timeout_s:g} s "
                                f"({len(both)} steps)" if time.monotonic() > deadline else None)
            if cut is not None:
                break
            time.sleep(poll_s)
        return (SwapSide(version=",".join(record["from_versions"]), steps={s: sum(old[s]) / len(old[s]) for s in both}),
                SwapSide(version=record["to_version"], steps={s: new[s] for s in both}), cut)

    def cost(self, run_id: str, sandbox: str, versions: list[str], steps: Collection[int]) -> Cost | None:
        """What the versions' episodes cost over `steps`: the core's per-version calls and tokens per episode
        (`episode/<sandbox>/version/<v>/calls|tokens`), averaged; None when it logged neither."""
        means = {}
        for name, metric in COST_METRICS.items():
            values = [v for version in versions
                      for s, v in read_history(self.client, run_id, f"episode/{sandbox}/version/{version}/{metric.split('/')[-1]}")
                      if s in steps]
            means[name] = sum(values) / len(values) if values else None
        return Cost(**means) if any(v is not None for v in means.values()) else None

    def before(self, run_id: str, record: dict, window: int) -> SwapSide:
        """The old version's last `window` steps up to the swap: the report's picture, never evidence."""
        steps: dict[int, float] = {}
        for version in record["from_versions"]:
            for s, v in read_history(self.client, run_id, f"reward/{record['sandbox']}/version/{version}"):
                if s <= (record["step"] or 0):
                    steps[s] = v
        return SwapSide(version=",".join(record["from_versions"]), steps=dict(sorted(steps.items())[-window:]))
