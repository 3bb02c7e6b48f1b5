"""Client runners: keep N episodes of an agent in flight, back off when they fail, give up, and stop in time.

`run_agent` opens `group_size` episodes per task and runs them concurrently under a semaphore. A
failed episode is retried (so its group can still fill), but failures are also counted: while the
last episode failed, the runner admits one episode at a time after an exponential backoff (the
`core.clients.retries.backoff_delay` schedule), so a failing client never opens episodes faster than it
finishes them. After `max_consecutive_failures` failed episodes in a row it gives up with one line
naming the error, the sandbox and the likely fix (`core.clients.failures`). Every rollout has a deadline (`--episode-timeout`):
one that runs past it, even while it still awaits (and so still heartbeats), is cancelled and its
episode aborted with a reason naming the sandbox's file and function; that counts as a failed
episode. A rollout that blocks its event loop cannot be cancelled: its heartbeats stop with it, so
the server expires its episodes by lease instead.

`run_client` is `swarm client`: the runner as its own OS process. It registers with the server
(id, sandbox, code version, host pid (`contain.host_pid`), host, kind, group size) and renews that registration as a
heartbeat; when the answer orders a drain (`swarm swap` took over with new code), it drains exactly
as on SIGTERM: in-flight episodes for at most one lease, then aborts what is left and exits 0. A
second SIGTERM, or SIGINT, exits at once. Both hold whether the server is up or gone. It also
leaves a local pid file (removed on every exit) so tools on this machine can find detached
clients; `swarm swap` does not use it. The runner does not know about training.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.clients.retries import ClientStopping, SwarmError
from core.clients.sdk import ABORT_DEADLINE_S, SwarmClient, person_token
from core.clients.deadline import EPISODE_TIMEOUT_S, rollout_source, within_limit
from core.clients.failures import ClientGaveUp, FailureGate, describe, likely_fix, sleep_unless
from core.clients.sandbox import Agent, Outcome, load_agent
from core.sandbox.folder import task_order
from core.clients.task_index import TaskIndex
from core.contain.contained import host_pid
from core.episodes.credentials import GRANT_ENV
from core.clients.pid_file import PidFile

log = logging.getLogger(__name__)

EPISODE_ATTEMPTS = 3  # a crashed episode is retried so its group can still fill
# Failed episodes in a row before a client gives up: with the backoff capped at a few seconds this is
# a minute or two of trying, enough to ride out a server restart, short enough to notice a broken sandbox.
MAX_CONSECUTIVE_FAILURES = 20
# How long one swarm call of a runner keeps retrying a server it cannot connect to; the failure count
# and backoff across episodes then decide how long the whole client waits for the server to return.
UNREACHABLE_S = 5.0
# The drain bound before any episode has told us its lease: the server's default `server.lease_s`.
DRAIN_FALLBACK_S = 60.0
DRAIN_POLL_S = 0.5  # how often an unbounded drain (the episode budget is spent) checks for a stop request
EXIT_GAVE_UP = 2  # `swarm client` exit code when it gives up (or cannot start)
EXIT_SIGTERM, EXIT_SIGINT = 143, 130  # the shell's codes for a process ended by these signals


@dataclass
class RunnerStats:
    finished: int = 0
    failed: int = 0
    aborted_on_stop: int = 0  # in-flight episodes cut off because the drain bound ran out
    rewards: list[float] = field(default_factory=list)


async def run_agent(
    agent: Agent,
    url: str,
    *,
    concurrency: int,
    group_size: int,
    kind: str = "train",
    split: str = "train",
    max_episodes: int = 0,
    max_tasks: int | None = None,
    stop: asyncio.Event | None = None,
    stats: RunnerStats | None = None,
    max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
    client_id: str | None = None,
    episode_timeout_s: float | None = None,
    seed: int | str | None = None,
    credential: str | None = None,
    person: str = "",
) -> RunnerStats:
    """Keep `concurrency` episodes in flight until `stop` is set or the episode/task budget is spent.
    `episode_timeout_s`: each rollout's deadline (None: EPISODE_TIMEOUT_S, 0: none). `seed`: the train
    split's tasks are drawn in an order shuffled by it, a new one each pass (None, and other splits: as yielded).
    `credential`: the client credential its run issued it (None: `$SWARMRL_CLIENT_GRANT`, `core.clients.sdk`);
    `person`: a person's admin token for a client no run launched (`run_client`).

    Raises `ClientGaveUp` after `max_consecutive_failures` failed episodes in a row (0: never)."""
    stop = stop or asyncio.Event()
    stats = stats or RunnerStats()
    client = SwarmClient(url, client_id=client_id or f"{agent.name}-{host_pid()}", client_version=agent.version,
                         unreachable_s=UNREACHABLE_S, credential=credential, person=person)
    gate = FailureGate(max_consecutive_failures)
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task] = set()
    leases = [0.0]  # the longest lease seen: the drain bound
    started = 0
    limit_s = EPISODE_TIMEOUT_S if episode_timeout_s is None else episode_timeout_s
    source = rollout_source(agent)
    own = TaskIndex(agent, split)  # an A/B's new version runs the task the server opened instead (its old version's)

    async def attempt(task: dict[str, Any] | None, task_id: str | None) -> BaseException | None:
        """One episode; None when it finished, else the error that ended it. A judged sandbox's (task None)
        gets its task from the server, which scores it by its judge."""
        try:
            async with client.aepisode(task_id, agent.name, group_size, kind, cancel=stop,
                                       split=split if task is None else None) as ep:
                leases[0] = max(leases[0], ep.lease_s)
                if task is not None and ep.task_id not in (None, task_id):
                    task = own.get(ep.task_id)
                out = await within_limit(agent.rollout(task if task is not None else ep.task, ep.openai), limit_s,
                                         source)
                out = out if isinstance(out, Outcome) else Outcome(float(out))
                await ep.finish(out.reward, out.metrics or None, out.answer)
        except Exception as e:  # agent code crashed or the server refused: the episode was aborted
            return e
        stats.finished += 1
        if isinstance(out.reward, (int, float)):
            stats.rewards.append(float(out.reward))
        return None

    async def one(task: dict[str, Any] | None, task_id: str | None) -> None:
        """A task's episode, retried so its group can still fill; a judged sandbox's once (a failed one is
        scored by the server with the judge's failure value and fills its group slot)."""
        try:
            for _ in range(EPISODE_ATTEMPTS if task is not None else 1):
                async with gate.admit(stop):
                    if stop.is_set():
                        return
                    error = await attempt(task, task_id)
                    if error is None:
                        gate.succeeded()
                        return
                    if isinstance(error, ClientStopping):
                        return
                    gate.failed(error)
                stats.failed += 1
                log.warning("%s: episode of task %s failed (%d in a row): %s", agent.name, task_id, gate.consecutive,
                            describe(error), exc_info=error if log.isEnabledFor(logging.DEBUG) else None)
                if gate.exhausted:
                    stop.set()
                    return
        finally:
            slots.release()

    def budget_spent() -> bool:
        return bool(max_episodes) and started >= max_episodes

    try:
        judged = await _judged_here(client, agent)
        if judged:  # the server deals the tasks (from the judge's split): run what it hands out
            episodes = max_tasks * group_size if max_tasks is not None else None
            while not stop.is_set() and not budget_spent() and (episodes is None or started < episodes):
                if not await _acquire(slots, stop):
                    break
                t = asyncio.create_task(one(None, None))
                running.add(t)
                t.add_done_callback(running.discard)
                started += 1
        tasks_done, passes = 0, 0
        while not judged and not stop.is_set() and not budget_spent() and (
                max_tasks is None or tasks_done < max_tasks):
            empty = True
            order_seed = f"{seed}/{passes}" if seed is not None and split == "train" else None
            passes += 1
            for index, task in task_order(agent.tasks(split), order_seed):
                empty = False
                task_id = str(task.get("id", index)) if isinstance(task, dict) else str(index)
                for _ in range(group_size):
                    if not await _acquire(slots, stop):
                        break
                    if budget_spent():
                        slots.release()
                        break
                    t = asyncio.create_task(one(task, task_id))
                    running.add(t)
                    t.add_done_callback(running.discard)
                    started += 1
                tasks_done += 1
                if stop.is_set() or budget_spent() or (max_tasks is not None and tasks_done >= max_tasks):
                    break
            if empty:
                raise ValueError(f"agent {agent.name!r} yielded no tasks for split {split!r}")
        await _drain(set(running), stop, lambda: leases[0] or DRAIN_FALLBACK_S, stats, agent.name)
    finally:
        for t in running:
            t.cancel()
        client.close()
    if gate.exhausted and gate.last_error is not None:
        raise ClientGaveUp(
            f"client {agent.name} gave up after {gate.consecutive} consecutive failed episodes against {url}: "
            f"{describe(gate.last_error)}. Likely fix: {likely_fix(gate.last_error, agent, url)}")
    return stats


async def _judged_here(client: SwarmClient, agent: Agent) -> bool:
    """Whether the server judges this sandbox (its status says; it alone decides, from the folders its config
    names): then it deals the tasks. A server that does not answer: what the sandbox's own sandbox.toml says."""
    try:
        status = await asyncio.to_thread(client.status)
    except SwarmError as e:
        log.warning("%s: cannot ask the server whether it judges this sandbox (%s); going by sandbox.toml", agent.name, e)
        return agent.judged
    return agent.name in status.get("judged", [])


async def _drain(tasks: set[asyncio.Task], stop: asyncio.Event, bound: Callable[[], float], stats: RunnerStats,
                 name: str) -> None:
    """Let in-flight episodes finish: all of them while nobody asked to stop, and from the moment `stop` is set
    for at most `bound()` seconds more; then cancel the rest (each aborts its episode)."""
    pending = tasks
    while pending and not stop.is_set():
        _, pending = await asyncio.wait(pending, timeout=DRAIN_POLL_S)
    if not pending:
        return
    bound_s = bound()
    _, pending = await asyncio.wait(pending, timeout=bound_s)
    if pending:
        log.warning("%s: %d episode(s) still in flight after %.0fs; aborting them", name, len(pending), bound_s)
        stats.aborted_on_stop += len(pending)
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=ABORT_DEADLINE_S + 1)


async def _acquire(slots: asyncio.Semaphore, stop: asyncio.Event) -> bool:
    """Wait for a free slot; False (nothing acquired) when `stop` is set first."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(slots.acquire(), timeout=0.2)
            return True
        except TimeoutError:
            continue
    return False


class Registration:
    """This client process in the server's client table (`core.episodes.client_table`): registered at start, renewed
    by a heartbeat whose answer may order a drain (a hot swap), removed on exit."""

    def __init__(self, url: str, info: dict, stats: RunnerStats, person: str = ""):
        self.info, self.stats, self.key = info, stats, ""
        self.client = SwarmClient(url, unreachable_s=UNREACHABLE_S, person=person)
        self.heartbeat_s = 1.0

    def beat(self) -> bool:
        """Register or renew (with the failed-episode count: `swarm swap` gives up on a new client that only
        fails); -> whether the server orders this client to drain."""
        orders = self.client.register({**self.info, "failed": self.stats.failed}, self.key, deadline_s=UNREACHABLE_S)
        self.key, self.heartbeat_s = orders["key"], float(orders["heartbeat_s"])
        return bool(orders["drain"])

    async def keep(self, stop: asyncio.Event, name: str) -> None:
        """Renew until `stop`; a drain order sets `stop`, so the runner drains exactly as on SIGTERM."""
        while not stop.is_set():
            await sleep_unless(stop, self.heartbeat_s)
            if stop.is_set():
                return
            try:
                drain = await asyncio.to_thread(self.beat)
            except SwarmError as e:  # the server is away: episodes fail and back off on their own
                log.warning("%s: client heartbeat failed: %s", name, e)
                continue
            if drain:
                log.info("%s: the server asks this client to drain (a hot swap): finishing in-flight episodes, "
                         "then exiting", name)
                stop.set()

    def leave(self) -> None:
        if self.key:
            self.client.leave(self.info["client_id"], self.key)
        self.client.close()


def new_client_id(name: str) -> str:
    """Unique per process and readable in `swarm status`: sandbox, host, a random part (pids are reused),
    and the pid last (`core.run.supervisor` credits a process's finished episodes by that suffix)."""
    return f"{name}-{socket.gethostname()}-{secrets.token_hex(2)}-{host_pid()}"


def run_client(spec: str, url: str, *, concurrency: int, episodes: int = 0, group_size: int | None = None,
               kind: str = "train", max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
               client_id: str | None = None, split: str = "train", max_tasks: int | None = None,
               episode_timeout_s: float | None = None, seed: str | None = None, code_version: str | None = None) -> int:
    """`swarm client`: run an agent against a server until done, drained or stopped; the exit code says how
    it ended. It registers with the server first (and gives up at once when it cannot). `code_version`: the
    version its launcher bound to its credential, reported instead of the one computed here (a contained
    client sees no git, so it would hash its files instead; the server decides either way)."""
    try:
        agent = load_agent(spec)
    except ValueError as e:
        log.error("%s", e)
        return EXIT_GAVE_UP
    if code_version:
        agent.version = code_version
    client_id = client_id or new_client_id(agent.name)
    stats = RunnerStats()
    try:
        if group_size is None:
            probe = SwarmClient(url, unreachable_s=UNREACHABLE_S)
            try:
                group_size = probe.status()["trainer"]["group_size"]
            finally:
                probe.close()
        # A person's `swarm client` (no run or swap launched it, so no credential): it opens with the person's admin
        # token, given or found in this machine's index of servers (a server that trains takes no anonymous opens).
        # A contained client never finds the index (`core.local_state.token_files`).
        person = "" if os.environ.get(GRANT_ENV) else person_token(url)
        registration = Registration(url, {
            "client_id": client_id, "sandbox": agent.name, "version": agent.version, "pid": host_pid(),
            "host": socket.gethostname(), "kind": kind, "group_size": group_size, "concurrency": concurrency,
            "spec": spec, "seed": seed, "split": split, "tasks": max_tasks, "episode_timeout": episode_timeout_s},
            stats, person)
        registration.beat()
    except SwarmError as e:
        log.error("client %s cannot start: %s. Likely fix: start the swarm server (`swarm serve ...`) or point "
                  "--server at a running one", agent.name, e)
        return EXIT_GAVE_UP
    log.info("client %s registered as %s (version %s, kind %s, group size %d)", agent.name, client_id, agent.version,
             kind, group_size)
    pid_file = PidFile.create(agent.name, url)

    def exit_now(code: int, why: str) -> None:
        log.warning("%s: exiting now; episodes in flight expire on the server", why)
        pid_file.remove()
        logging.shutdown()
        os._exit(code)

    async def main() -> RunnerStats:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()

        def on_sigterm() -> None:
            if stop.is_set():
                exit_now(EXIT_SIGTERM, "second SIGTERM")
            log.info("SIGTERM: draining in-flight episodes for at most one lease (SIGTERM again or SIGINT: exit now)")
            stop.set()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        loop.add_signal_handler(signal.SIGINT, lambda: exit_now(EXIT_SIGINT, "SIGINT"))
        beating = asyncio.create_task(registration.keep(stop, agent.name))
        try:
            return await run_agent(agent, url, concurrency=concurrency, group_size=group_size, kind=kind,
                                   max_episodes=episodes, stop=stop, max_consecutive_failures=max_consecutive_failures,
                                   client_id=client_id, stats=stats, split=split, max_tasks=max_tasks,
                                   episode_timeout_s=episode_timeout_s, seed=seed, person=person)
        finally:
            stop.set()
            await beating

    try:
        stats = asyncio.run(main())
    except ClientGaveUp as e:
        log.error("%s", e)
        return EXIT_GAVE_UP
    except KeyboardInterrupt:  # before the loop's own SIGINT handler was installed
        return EXIT_SIGINT
    finally:
        registration.leave()
        pid_file.remove()
    log.info("client %s done: %d finished, %d failed, %d aborted on stop", agent.name, stats.finished, stats.failed,
             stats.aborted_on_stop)
    return 0
