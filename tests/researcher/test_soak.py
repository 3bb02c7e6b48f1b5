"""The soak bench: its books catch planted bad states, and a short soak under random kills balances them."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from bench.soak_books import Books, CoreRunRecord, Lifetime, check, drift_tolerance_s
from tests.researcher.harness import ROOT

T0 = 1_000_000.0
AT_T0 = datetime.fromtimestamp(T0, timezone.utc).isoformat()  # a decision's `at`, as the study records it


def _launch(key: str, proposal: str, start: float, end: float, status: str = "finished",
            run_id: str | None = None) -> dict:
    return {"key": key, "proposal_id": proposal, "seed": 0, "steps": 2, "status": status, "run_id": run_id or key,
            "started_at": start, "ended_at": end}


def _run(run_id: str, launch: str, proposal: str, status: str = "FINISHED") -> CoreRunRecord:
    return CoreRunRecord(run_id=run_id, launch=launch, proposal=proposal, seed="0", status=status,
                         start_s=T0, end_s=T0 + 10)


def _clean() -> tuple[dict, list[str], list[CoreRunRecord], dict[str, str], list[Lifetime]]:
    """Two proposals, one approved and run for 10 s, one pending: books that balance."""
    state = {"proposals": [{"id": "r1-1"}, {"id": "r1-2"}],
             "decisions": [{"proposal_id": "r1-1", "verdict": "approved", "at": AT_T0}],
             "launches": [_launch("r1-1-s0", "r1-1", T0, T0 + 10)]}
    board = {"r1-1": "approved", "r1-2": "pending"}
    return state, ["r1-2"], [_run("r1-1-s0", "r1-1-s0", "r1-1")], board, [Lifetime(7, "r1-1-s0", T0, T0 + 10)]


def _books(state, waiting, runs, board, lifetimes) -> Books:
    return check(state, waiting, runs, board, lifetimes)


def test_books_of_a_clean_study_balance() -> None:
    books = _books(*_clean())
    assert (books.launches, books.duplicates, books.lost, books.stuck, books.budget_drift_s) == (1, 0, 0, 0, 0.0)
    assert books.problems == []
    assert books.line(kills=3) == ("soak: kills=3 launches=1 duplicates=0 lost=0 budget_drift_s=0.0 stuck=0 "
                                   "approve_to_launch_max_s=0.0")


def test_books_count_two_finished_runs_of_one_proposal_and_seed_as_a_duplicate() -> None:
    state, waiting, runs, board, lifetimes = _clean()
    runs.append(_run("second", "r1-1-s0", "r1-1"))  # a launch started twice, both runs finished
    books = _books(state, waiting, runs, board, lifetimes)
    assert books.duplicates == 1 and books.lost == 0
    assert "duplicate: r1-1 seed 0 counts 2 FINISHED" in books.problems[0]
    # A killed first attempt next to its finished re-run does not count twice.
    runs[-1] = _run("second", "r1-1-s0", "r1-1", status="KILLED")
    assert _books(state, waiting, runs, board, lifetimes).duplicates == 0


def test_books_count_a_finished_run_missing_from_the_state_as_lost() -> None:
    state, waiting, runs, board, lifetimes = _clean()
    state["launches"][0]["status"] = "failed"  # the state thinks it failed, MLflow has it FINISHED
    books = _books(state, waiting, runs, board, lifetimes)
    assert books.lost == 1 and "lost: MLflow run r1-1-s0" in books.problems[0]


def test_books_count_a_proposal_neither_decided_nor_pending_as_stuck() -> None:
    state, waiting, runs, board, lifetimes = _clean()
    board["r1-3"] = "pending"  # on the review board, but the study neither waits on it nor decided it
    books = _books(state, [], runs, board, lifetimes)
    assert books.stuck == 2 and {p.split()[1] for p in books.problems} == {"r1-2", "r1-3"}


def test_books_hold_a_policy_decision_of_a_round_still_in_review_as_in_review_not_stuck() -> None:
    state, _, runs, board, lifetimes = _clean()
    state["proposals"] = [{"id": "r3-1", "round": 3}, {"id": "r3-4", "round": 3}, {"id": "r2-1", "round": 2}]
    state["decisions"] = []
    board.clear()
    board.update({"r3-1": "pending", "r3-4": "approved", "r2-1": "approved"})  # r3-4: a baseline, by policy
    books = _books(state, ["r3-1"], runs, board, lifetimes)
    assert books.problems == ["stuck: r2-1 is neither decided nor pending (board: approved)"]  # its round is over


def test_books_count_an_approved_proposal_that_never_launched_as_stuck() -> None:
    state, waiting, runs, board, lifetimes = _clean()
    state["decisions"].append({"proposal_id": "r1-2", "verdict": "approved", "at": AT_T0})  # approved; no launch followed
    books = _books(state, [], runs, board, lifetimes)
    assert books.stuck == 1 and books.problems == ["stuck: r1-2 was approved and never launched"]
    state["launches"].append(_launch("r1-2-s0", "r1-2", T0, T0, status="skipped"))  # skipped for budget: launched
    assert _books(state, [], runs, board, lifetimes).stuck == 0


def test_books_time_each_approval_to_its_first_launch_and_an_unlaunched_one_to_now() -> None:
    state, waiting, runs, board, lifetimes = _clean()
    approved_at = datetime.fromtimestamp(T0 - 30, timezone.utc).isoformat()
    state["decisions"] = [{"proposal_id": "r1-1", "verdict": "approved", "at": approved_at},
                          {"proposal_id": "r1-2", "verdict": "approved", "at": approved_at}]
    state["launches"].append(_launch("r1-1-s1", "r1-1", T0 + 50, T0 + 60))  # a later seed: the first launch counts
    books = check(state, [], runs, board, lifetimes, now=T0 + 570)
    assert books.approve_to_launch_s == {"r1-1": pytest.approx(30.0), "r1-2": pytest.approx(600.0)}
    assert books.longest_approve_to_launch_s == pytest.approx(600.0)  # r1-2 still waits: its wait so far
    assert books.line(kills=0).endswith("stuck=1 approve_to_launch_max_s=600.0")


def test_books_measure_budget_drift_against_the_observed_processes() -> None:
    state, waiting, runs, board, _ = _clean()
    state["launches"].append(_launch("r1-1-s0-rerun", "r1-1", T0 + 100, T0 + 160, status="failed"))
    books = _books(state, waiting, runs, board, [Lifetime(7, "r1-1-s0", T0, T0 + 10)])
    assert books.budget_drift_s == pytest.approx(60.0)  # a minute billed that no process ran
    assert books.budget_drift_s > drift_tolerance_s(books.observed_s, books.launches)


# The soak's own bounds stretch with the host's measured slowness (bench/soak.py), so this is only a
# backstop against a hang: a 3-minute soak on a host 5x slower than a quiet one, and its start-up.
SOAK_TIMEOUT_S = 2400


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(SOAK_TIMEOUT_S + 60)
def test_three_minute_soak_under_random_kills_keeps_its_books() -> None:
    done = subprocess.run([sys.executable, "bench/soak.py", "--minutes", "3", "--seed", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=SOAK_TIMEOUT_S)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    books = re.fullmatch(r"soak: kills=(\d+) launches=(\d+) duplicates=(\d+) lost=(\d+) "
                         r"budget_drift_s=(-?[\d.]+) stuck=(\d+) approve_to_launch_max_s=([\d.]+)", last)
    assert books, f"no books line:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    kills, launches, duplicates, lost, _, stuck, _ = books.groups()
    assert int(kills) > 0 and int(launches) > 0, done.stdout
    assert (duplicates, lost, stuck) == ("0", "0", "0"), done.stdout
    assert done.returncode == 0, done.stdout[-3000:]
