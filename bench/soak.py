"""Soak: one study on the tiny model, for a fixed wall time, under random kills; then its books.

    python bench/soak.py                 # 30 minutes
    python bench/soak.py --minutes 3 --seed 1

The soak starts a real `mlflow server` (SQLite in a temporary folder) and a study of the tiny
model's learning rate whose every proposal waits for a person (`approval: human`). For the first
`CHAOS_SHARE` of the time a chaos driver acts at random intervals (seeded by `--seed`):

- kill -9 the study process, then `researcher study resume --all`;
- kill -9 a running core run (`swarm run` of the study);
- stop the MLflow server and start it again a few seconds later;
- approve or veto pending proposals, with `researcher study approve|veto` or by setting
  `review.status` (and `review.reason`, `review.by`) on the proposal's run with `MlflowClient`;
- once, a reboot: every process of the soak killed at once, then MLflow and the study restarted.

A study that exits on its own (not killed) is counted as `study_exit`, its log tail printed, and
resumed. Then the chaos stops and the study settles: it is resumed, what is pending is vetoed (once,
and again whenever a pending proposal holds back approved work of its round), and the soak waits
until no run is running, every approved proposal has launched, and the study is waiting for review
or done.

The soak's clock follows the study's progress, not the wall: the chaos starts when the study has
published its first proposal, and the host's speed is measured by how long that took
(`startup_s` against `QUIET_STARTUP_S`); the chaos lasts at least until a run has been seen, and every
bound (the chaos's extension, the settle, a command's time-out) stretches by that factor. A study
that publishes nothing, or launches nothing, fails the soak: it never passes on a study that did
no work.
The books (`bench/soak_books.py`) are computed from MLflow, the study state on disk and the
soak's own view of the `swarm run` processes. It prints a table of events and runs, then, last,
`soak: kills=<k> launches=<n> duplicates=<d> lost=<l> budget_drift_s=<x> stuck=<s>`, and exits 1
if duplicates, lost or stuck is not 0, the drift is over `drift_tolerance_s`, or a process of a
run outlives its run (orphans). It is a bench: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlflow.tracking import MlflowClient  # noqa: E402

from bench.soak_books import check, core_runs, drift_tolerance_s, unlaunched  # noqa: E402
from bench.soak_procs import MlflowServer, Watcher, cmdline, kill9, pids_matching  # noqa: E402
from researcher.study.runner import read_state  # noqa: E402
from researcher.study.store import study_paths  # noqa: E402

BIN = Path(sys.executable).parent
STUDY = "soak"
CHAOS_SHARE = 0.7  # of the wall time; the rest is for settling and the books
GAP_S = (2.0, 6.0)  # random wait between two chaos events
MLFLOW_DOWN_S = (2.0, 12.0)  # how long a stopped MLflow server stays down
APPROVE_P = 0.7  # a decision is an approval with this chance, else a veto
ACTIONS = {"kill_study": 2, "kill_run": 2, "bounce_mlflow": 1, "decide_cli": 3, "decide_tag": 3}
SETTLE_OVER_S = 240  # the settle may run this long past the wall time before the soak gives up on it
# Seconds from `researcher study start` to its first pending proposal on a quiet 2-core host (docs/benchmarks.md,
# "Soak beside a CPU hog"): the host's speed is measured against it, so a busy host gets longer bounds.
QUIET_STARTUP_S = 25.0
FIRST_PROPOSAL_BOUND_S = 1200  # no proposal after this long: the study is stuck, whatever the host
CLI_TIMEOUT_S = 120  # one `researcher study ...` command on a quiet host

BRIEF = """---
title: soak (tiny learning rate, every proposal reviewed by a person)
objective: {{metric: reward/mean, direction: maximize, window: 2}}
budget: {{max_runs: 100000, max_total_steps: 10000000, wall_clock: 1000h, max_rounds: 100000}}
run:
  base_config: configs/tiny.yaml
  overrides: {{trainer.steps: 2, trainer.batch_groups: 2}}
search_space:
  trainer.lr: {{kind: range, low: 1.0e-4, high: 1.0e-1, log: true}}
seeds: [0]
approval: {{config_only: human, code_change: human}}
planner: {{seed: {seed}, heuristic: {{arms: {arms}, eta: 2, min_steps: 2}}}}
launch: {{concurrency: 2, grace_s: 5}}
monitor: {{poll_s: 1, collapse_drop: null}}
review: {{poll_s: 1}}
---
The soak's study: long enough that it is still searching when the wall time is up.
"""


class Soak:
    def __init__(self, tmp: Path, seed: int, minutes: float) -> None:
        self.tmp, self.rng, self.minutes = tmp, random.Random(seed), minutes
        self.studies = tmp / "studies"
        self.paths = study_paths(self.studies, STUDY)
        self.events: Counter[str] = Counter()
        self.kills = 0
        self.notes: list[str] = []
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "200"}
        self.mlflow = MlflowServer(BIN / "mlflow", tmp, self.env)
        self.env["MLFLOW_TRACKING_URI"] = self.mlflow.uri
        # The soak's own MLflow calls fail fast while the server is down (the study's keep MLflow's retries).
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "10"
        self.client = MlflowClient(self.mlflow.uri)
        self.watcher = Watcher(self.paths.state / "runs")
        self.killed_study = False  # the study is dead because the soak killed it
        self.slow = 1.0  # the host's slowness against a quiet one, measured at start (`wait_for_work`)
        self.startup_s = 0.0

    # -- the study ---------------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str] | None:
        timeout *= self.slow
        argv = [str(BIN / "researcher"), "study", "--studies-dir", str(self.studies), *args]
        try:
            return subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.events[f"cli_timeout:{args[0]}"] += 1
            return None

    def study_pid(self) -> int | None:
        try:
            pid = int(self.paths.pid.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if "researcher" in cmdline(pid) and str(self.studies) in cmdline(pid) else None

    def study_pids(self) -> list[int]:
        """Every researcher process of the study: the owner, and resumes that wait for its lock."""
        return [p for p in pids_matching(str(self.studies)) if "researcher" in cmdline(p) and "study" in cmdline(p)]

    def done(self) -> bool:
        values, nxt, _ = read_state(self.paths, STUDY)
        return bool(values) and not nxt

    def resume(self) -> None:
        done = self.cli("resume", "--all")
        self.events["resume"] += 1
        if done is None or done.returncode != 0:
            self.notes.append(f"resume --all failed: {done.stdout[-500:] + done.stderr[-500:] if done else 'timeout'}")
        self.killed_study = False

    def keep_alive(self) -> None:
        """A study that is gone though the soak did not kill it exited on its own: say so, resume it."""
        if self.study_pids() or self.done():
            return
        if not self.killed_study:
            self.events["study_exit"] += 1
            tail = self.paths.log.read_text(errors="replace").splitlines()[-8:] if self.paths.log.exists() else []
            self.notes.append("study exited on its own:\n    " + "\n    ".join(tail))
        self.resume()

    # -- chaos actions -----------------------------------------------------------------------------
    def kill_study(self) -> None:
        pids = self.study_pids()
        for pid in pids:
            self.kills += kill9(pid)
        self.killed_study = True
        self.events["kill_study" if pids else "kill_study:none_running"] += 1
        time.sleep(self.rng.uniform(0, 3))
        self.resume()

    def kill_run(self) -> None:
        alive = self.watcher.poll()
        if not alive:  # nothing to kill: move the study on instead, so that later kills find runs
            self.events["kill_run:none_running"] += 1
            return self.decide_cli()
        pid = self.rng.choice(alive)
        self.kills += kill9(pid)
        self.watcher.killed(pid)
        self.events["kill_run"] += 1

    def bounce_mlflow(self) -> None:
        self.mlflow.stop()
        time.sleep(self.rng.uniform(*MLFLOW_DOWN_S))
        self.events["mlflow_restart"] += 1
        self.mlflow.start()

    def pending(self) -> list[tuple[str, str]]:
        """(proposal id, run id) of the proposals the board shows pending; [] while MLflow is down."""
        try:
            exp = self.client.get_experiment_by_name(f"study-{STUDY}")
            if exp is None:
                return []
            runs = self.client.search_runs([exp.experiment_id], "tags.`review.status` = 'pending' AND "
                                           "tags.`swarmrl.kind` = 'proposal'")
        except Exception:  # noqa: BLE001 - MlflowException or a connection error: the server is down
            return []
        return sorted((r.data.tags["swarmrl.proposal"], r.info.run_id) for r in runs)

    def picks(self) -> list[tuple[str, str]]:
        pending = self.pending()
        return self.rng.sample(pending, min(len(pending), self.rng.randint(1, 3))) if pending else []

    def decide_cli(self) -> None:
        for pid, _ in self.picks():
            verdict = "approve" if self.rng.random() < APPROVE_P else "veto"
            done = self.cli(verdict, STUDY, pid, "--by", "soak-cli", "--reason", f"soak {verdict}")
            ok = done is not None and done.returncode == 0
            self.events[f"{verdict}_cli" if ok else f"{verdict}_cli:refused"] += 1

    def decide_tag(self) -> None:
        for pid, run_id in self.picks():
            verdict = "approved" if self.rng.random() < APPROVE_P else "vetoed"
            try:  # as a person does in the UI: the reason and name first, the status last
                self.client.set_tag(run_id, "review.reason", f"soak {verdict} by tag")
                self.client.set_tag(run_id, "review.by", "soak-tag")
                self.client.set_tag(run_id, "review.status", verdict)
                self.events[f"{verdict}_tag"] += 1
            except Exception:  # noqa: BLE001 - the server is down: the edit did not happen
                self.events[f"{verdict}_tag:failed"] += 1

    def reboot(self) -> None:
        """Everything at once, as a power cut: the study, its runs and their clients, the MLflow server."""
        runs = self.watcher.poll()
        for pid in self.study_pids():
            self.kills += kill9(pid)
        for pid in runs:
            self.kills += kill9(pid, group=True)  # a run leads its session: its clients go with it
            self.watcher.killed(pid)
        for pid in pids_matching(str(self.tmp)):
            kill9(pid)
        self.mlflow.stop(hard=True)
        self.killed_study = True
        self.events["reboot"] += 1
        time.sleep(2)
        self.mlflow.start()
        self.resume()

    # -- phases ------------------------------------------------------------------------------------
    def approve_first(self, until: float) -> None:
        """The chaos needs runs to kill and the books need launches: the first proposal to show up pending
        is approved at once, whatever the dice say later."""
        while time.monotonic() < until:
            for pid, _ in self.pending()[:1]:
                done = self.cli("approve", STUDY, pid, "--by", "soak-cli", "--reason", "soak: the first approval")
                if done is not None and done.returncode == 0:
                    self.events["approve_cli"] += 1
                    return
                self.events["approve_cli:refused"] += 1
            time.sleep(1)

    def wait_for_work(self, started: float) -> bool:
        """Wait for the study's first pending proposal; measure the host's slowness by how long it took."""
        while not self.pending():
            if time.monotonic() - started > FIRST_PROPOSAL_BOUND_S:
                return False
            self.keep_alive()
            time.sleep(1)
        self.startup_s = time.monotonic() - started
        self.slow = max(1.0, self.startup_s / QUIET_STARTUP_S)
        return True

    def launched(self) -> bool:
        """A run has been seen, or the state holds a launch that started."""
        values, _, _ = read_state(self.paths, STUDY)
        return bool(self.watcher.all()) or any(x.get("started_at") for x in values.get("launches", []))

    def chaos(self, until: float, reboot_at: float, longest: float) -> None:
        """Random chaos until `until`, and on past it (up to `longest`) while no run has been seen yet:
        a chaos that ends before the first launch tests nothing about runs."""
        actions, weights = zip(*ACTIONS.items())
        rebooted = False
        self.approve_first(until)
        while time.monotonic() < until or (time.monotonic() < longest and not self.launched()):
            time.sleep(self.rng.uniform(*GAP_S))
            if self.done():
                self.notes.append("the study finished during the chaos (give it a larger search)")
                return
            if not rebooted and time.monotonic() >= reboot_at:
                self.reboot()
                rebooted = True
            else:
                getattr(self, self.rng.choices(actions, weights)[0])()
            self.keep_alive()

    def settle(self, until: float) -> bool:
        """Resume, veto what is pending, and wait until nothing runs, every approved proposal has been
        launched, and the study is done or waits on proposals the settle did not veto (a new round's).
        A round launches once all its proposals are decided, so a pending proposal that holds back approved
        work is vetoed too, however late it appeared; a veto that did not go through is tried again."""
        self.keep_alive()
        vetoed: set[str] = set()
        calm = 0
        while time.monotonic() < until:
            time.sleep(2)
            self.keep_alive()
            values, nxt, waiting = read_state(self.paths, STUDY)
            running = [x for x in values.get("launches", []) if x.get("status") in ("queued", "running")]
            held_back = unlaunched(values)
            todo = [w for w in waiting if w not in vetoed] if (held_back or not vetoed) else []
            if todo:
                done = self.cli("veto", STUDY, *todo, "--by", "soak-settle", "--reason", "soak: settling")
                if done is not None and done.returncode == 0:
                    self.events["veto_settle"] += len(todo)
                    vetoed.update(todo)
                else:
                    self.events["veto_settle:refused"] += 1
                continue
            waits_on_new = bool(waiting) and vetoed.isdisjoint(waiting)  # the vetoes were taken in
            at_rest = ((not nxt or waits_on_new) and not running and not held_back
                       and not self.watcher.poll())
            calm = calm + 1 if at_rest else 0
            if calm >= 2:  # two looks in a row: not a moment between two nodes
                return True
        return False

    def run(self) -> int:
        t0 = time.monotonic()  # the wall time counts from here: start-up and the books are in it
        self.studies.mkdir(parents=True)
        arms = max(6, int(2 * self.minutes))
        brief = self.tmp / "soak.md"
        brief.write_text(BRIEF.format(seed=self.rng.randint(0, 10_000), arms=arms))
        self.mlflow.start()
        started = self.cli("start", str(brief), "--name", STUDY, "--planner", "heuristic", "--detach")
        if started is None or started.returncode != 0:
            print(started.stdout + started.stderr if started else "start timed out", file=sys.stderr)
            return 2
        self.watcher.start()
        if not self.wait_for_work(t0):
            print(f"soak: the study published no proposal in {FIRST_PROPOSAL_BOUND_S} s", file=sys.stderr)
            return 1
        wall = self.minutes * 60
        chaos_s = CHAOS_SHARE * wall
        c0 = time.monotonic()  # the chaos's clock starts with the study's first proposal, not before
        self.chaos(c0 + chaos_s, c0 + self.rng.uniform(0.4, 0.7) * chaos_s, c0 + chaos_s * self.slow)
        chaos_end = time.monotonic()
        settled = self.settle(chaos_end + max(wall - chaos_s, 30.0) * self.slow + SETTLE_OVER_S * self.slow)
        settle_s = time.monotonic() - chaos_end
        self.cli("stop", STUDY)
        for pid in self.study_pids():
            kill9(pid)
        self.watcher.close()
        orphans = [p for p in pids_matching(str(self.paths.state / "runs")) if p != os.getpid()]
        values, _, waiting = read_state(self.paths, STUDY)
        runs, board = core_runs(self.client, f"study-{STUDY}", STUDY)
        books = check(values, waiting, runs, board, self.watcher.all())
        tolerance = drift_tolerance_s(books.observed_s, books.launches)
        self.print_table(values, runs, books, tolerance, orphans, chaos_end - c0, settle_s, settled)
        for pid in orphans:
            kill9(pid)
        self.mlflow.stop()
        print(books.line(self.kills))
        ok = (not books.duplicates and not books.lost and not books.stuck and abs(books.budget_drift_s) <= tolerance
              and not orphans and settled and books.launches > 0)
        return 0 if ok else 1

    def print_table(self, values: dict, runs: list, books, tolerance: float, orphans: list[int], chaos_s: float,
                    settle_s: float, settled: bool) -> None:
        print(f"\nsoak of study '{STUDY}': first proposal after {self.startup_s:.0f} s (host {self.slow:.1f}x "
              f"slower than quiet), chaos {chaos_s:.0f} s, settle {settle_s:.0f} s "
              f"({'settled' if settled else 'NOT settled'}), folder {self.tmp}")
        print(f"\n{'event':<28}{'count':>7}")
        for kind, n in sorted(self.events.items()):
            print(f"{kind:<28}{n:>7}")
        print(f"{'kills (kill -9 of study or run)':<28}{self.kills:>7}")
        launches = Counter(x.get("status") for x in values.get("launches", []))
        mlflow_runs = Counter(r.status for r in runs)
        decisions = Counter(f"{d['verdict']} ({d['source']})" for d in values.get("decisions", []))
        print(f"\n{'what':<28}{'count':>7}")
        rows = [("proposals", len(values.get("proposals", []))), ("pending at the end", len(read_state(self.paths, STUDY)[2]))]
        rows += [(f"decision {k}", n) for k, n in sorted(decisions.items())]
        rows += [(f"launch {k}", n) for k, n in sorted(launches.items())]
        rows += [(f"MLflow core run {k}", n) for k, n in sorted(mlflow_runs.items())]
        rows += [("swarm run processes seen", len(self.watcher.all())), ("orphan processes at the end", len(orphans))]
        for what, n in rows:
            print(f"{what:<28}{n:>7}")
        for pid, wait in sorted(books.approve_to_launch_s.items()):
            print(f"{'approval -> launch ' + pid:<28}{wait:>7.1f} s")
        if not books.launches:
            print("  the study launched nothing: the soak tested no run")
        print(f"\ncompute: budget {books.budget_s:.1f} s, observed processes {books.observed_s:.1f} s, "
              f"drift {books.budget_drift_s:+.1f} s (tolerance ±{tolerance:.1f} s)")
        for line in books.problems + self.notes:
            print("  " + line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="wall time of the whole soak")
    parser.add_argument("--seed", type=int, default=0, help="seeds the chaos driver and the study's planner")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (studies, MLflow store, logs)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swarmrl-soak-"))
    soak = Soak(tmp, args.seed, args.minutes)
    try:
        return soak.run()
    finally:
        for pid in pids_matching(str(tmp)):  # nothing of the soak outlives it, whatever happened
            kill9(pid)
        soak.mlflow.stop(hard=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
