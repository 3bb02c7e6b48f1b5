"""The soak's books: what a study's disk state and MLflow say happened, checked against each other.

`bench/soak.py` runs a study under random kills; at the end it reads three independent records and
hands them to `check`:

- the core runs as MLflow has them (`CoreRunRecord`, read by `core_runs`);
- the study's checkpointed state on disk (proposals, decisions, launches, the budget's compute time);
- the lifetimes of the `swarm run` processes the soak itself saw in /proc (`Lifetime`).

It computes, never from the study's own counters of these things:

- duplicates: two core runs for one (proposal, seed) that both count (FINISHED in MLflow, or
  `finished` launches in the state);
- lost: a core run MLflow has FINISHED whose launch the state does not hold as finished;
- budget_drift_s: the budget's compute time (`researcher.budget.Spent.wall_s` of the state) minus
  the union of the observed process lifetimes;
- stuck: a proposal (in the state or on the review board in MLflow) neither decided in the state
  nor among those the study's review waits on (nor decided on the board by the review node of a round
  it still waits on), or approved in the state and never launched;
- approve_to_launch_s: for every approved proposal, the seconds from its approval (the decision's
  `at`) to the start of its first launch, and the longest of them (a proposal approved and never
  launched counts up to the moment the books are read).

It is pure arithmetic over those records (the planted-state tests feed it by hand); it starts,
kills or decides nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from researcher.budget import Spent, interval_union


@dataclass(frozen=True)
class CoreRunRecord:
    """One core run of the study as MLflow has it."""

    run_id: str
    launch: str  # the `swarmrl.launch` tag (a re-run continuing the run may have retagged it)
    proposal: str
    seed: str
    status: str  # MLflow's: RUNNING, FINISHED, FAILED, KILLED
    start_s: float
    end_s: float | None


@dataclass(frozen=True)
class Lifetime:
    """A `swarm run` process of the study, from its start (/proc) to the last time it was seen alive."""

    pid: int
    launch: str
    start_s: float
    last_seen_s: float


@dataclass
class Books:
    launches: int
    duplicates: int
    lost: int
    budget_drift_s: float
    stuck: int
    observed_s: float  # the union of the observed process lifetimes
    budget_s: float  # the budget's compute time
    problems: list[str] = field(default_factory=list)  # one line per thing that does not add up
    # proposal -> seconds from its approval to its first launch's start (`approve_to_launch`)
    approve_to_launch_s: dict[str, float] = field(default_factory=dict)

    @property
    def longest_approve_to_launch_s(self) -> float:
        return max(self.approve_to_launch_s.values(), default=0.0)

    def line(self, kills: int) -> str:
        return (f"soak: kills={kills} launches={self.launches} duplicates={self.duplicates} lost={self.lost} "
                f"budget_drift_s={self.budget_drift_s:.1f} stuck={self.stuck} "
                f"approve_to_launch_max_s={self.longest_approve_to_launch_s:.1f}")


def drift_tolerance_s(observed_s: float, launches: int) -> float:
    """How far the budget may be from the observed lifetimes. A run's end, to the budget, is its log's
    last write; a run killed while quiet (loading its model) stopped writing a few seconds before it
    died, and the soak sees a process only every poll: 3 s a launch, or 5 % of the compute, whichever is more."""
    return max(3.0 * max(launches, 1), 0.05 * observed_s)


def core_runs(client: MlflowClient, experiment: str, study: str) -> tuple[list[CoreRunRecord], dict[str, str]]:
    """The study's core runs, and its proposals on the review board (id -> `review.status`)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return [], {}
    runs, board = [], {}
    for r in client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=50000):
        tags = r.data.tags
        if tags.get("swarmrl.study") != study:
            continue
        if tags.get("swarmrl.kind") == "proposal":
            board[tags.get("swarmrl.proposal", "")] = tags.get("review.status", "")
        elif "swarmrl.launch" in tags:
            runs.append(CoreRunRecord(run_id=r.info.run_id, launch=tags["swarmrl.launch"],
                                      proposal=tags.get("swarmrl.proposal", ""), seed=tags.get("swarmrl.seed", ""),
                                      status=r.info.status, start_s=r.info.start_time / 1000,
                                      end_s=r.info.end_time / 1000 if r.info.end_time else None))
    return runs, board


def unlaunched(state: dict[str, Any]) -> list[str]:
    """Proposals the state has approved that no launch (of any status, skipped included) belongs to."""
    launched = {x["proposal_id"] for x in state.get("launches", [])}
    return sorted({d["proposal_id"] for d in state.get("decisions", []) if d.get("verdict") == "approved"} - launched)


def approve_to_launch(state: dict[str, Any], now: float | None = None) -> dict[str, float]:
    """Approved proposal -> seconds from its approval to its first launch's start; for one not launched yet,
    to `now` (so a proposal that waits forever shows as the longest wait, not as no wait)."""
    now = time.time() if now is None else now
    first: dict[str, float] = {}
    for x in state.get("launches", []):
        start = x.get("started_at")
        if start is not None:
            first[x["proposal_id"]] = min(first.get(x["proposal_id"], start), start)
    out: dict[str, float] = {}
    for d in state.get("decisions", []):
        if d.get("verdict") != "approved":
            continue
        approved = datetime.fromisoformat(d["at"]).timestamp()
        out[d["proposal_id"]] = max(0.0, first.get(d["proposal_id"], now) - approved)
    return out


def check(state: dict[str, Any], waiting: list[str], runs: list[CoreRunRecord], board: dict[str, str],
          lifetimes: list[Lifetime], now: float | None = None) -> Books:
    problems: list[str] = []
    launches = [x for x in state.get("launches", []) if x.get("status") not in ("queued", "skipped")]
    finished = [x for x in launches if x.get("status") == "finished"]

    duplicates = 0
    counted = Counter((r.proposal, r.seed) for r in runs if r.status == "FINISHED")
    counted_in_state = Counter((x["proposal_id"], str(x["seed"])) for x in finished)
    for (proposal, seed), n in sorted((counted + counted_in_state).items()):
        extra = max(0, counted[(proposal, seed)] - 1) + max(0, counted_in_state[(proposal, seed)] - 1)
        if extra:
            duplicates += extra
            problems.append(f"duplicate: {proposal} seed {seed} counts {counted[(proposal, seed)]} FINISHED "
                            f"MLflow run(s) and {counted_in_state[(proposal, seed)]} finished launch(es)")

    held = {x.get("run_id") for x in finished} | {x["key"] for x in finished}
    lost = 0
    for r in runs:
        if r.status == "FINISHED" and r.run_id not in held and r.launch not in held:
            lost += 1
            problems.append(f"lost: MLflow run {r.run_id} ({r.launch}) is FINISHED; the state has no finished launch of it")

    decided = {d["proposal_id"] for d in state.get("decisions", [])}
    proposals = {p["id"] for p in state.get("proposals", [])} | set(board)
    # The review node decides a round's baselines and stages by policy on the board at once, but the state holds
    # those decisions only when the node returns, after the round's last person's decision: while it waits, a
    # proposal of a waiting round that the board shows decided is in review, not stuck.
    rounds = {p["id"]: p.get("round") for p in state.get("proposals", [])}
    reviewing = {rounds.get(w) for w in waiting} - {None}
    in_review = {p for p in proposals if rounds.get(p) in reviewing and board.get(p) in ("approved", "vetoed")}
    stuck = sorted(p for p in proposals if p not in decided and p not in waiting and p not in in_review)
    problems += [f"stuck: {p} is neither decided nor pending (board: {board.get(p, 'absent')})" for p in stuck]
    never = unlaunched(state)
    stuck += never
    problems += [f"stuck: {p} was approved and never launched" for p in never]

    observed = interval_union([(x.start_s, x.last_seen_s) for x in lifetimes])
    budget = Spent.of(state).wall_s
    return Books(launches=len(launches), duplicates=duplicates, lost=lost, budget_drift_s=budget - observed,
                 stuck=len(stuck), observed_s=observed, budget_s=budget, problems=problems,
                 approve_to_launch_s=approve_to_launch(state, now))
