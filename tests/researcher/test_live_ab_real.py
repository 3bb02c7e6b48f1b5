"""A live A/B that compares only code, with real processes: `bench/rigor_live.py` on a tiny `swarm run`.

A null swap (versions that differ by a comment) into a live run of the judged `letters` sandbox,
judged over three paired steps as a study judges it (`researcher.evidence.ab`), the loser drained.
What must hold at every judged step and in every compared pair: no trained group mixed versions while
both versions trained, each compared pair holds one task and one weights version with
episodes of both versions, and the verdict is the study's HAC test on those steps. This is the path
`bench/rigor.py` takes for its `live_trials` figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# One trial holds every property checked below; `bench/rigor.py` runs five for its `live_trials` figure.
TRIALS, WINDOW = 1, 3


def test_a_live_ab_pairs_tasks_and_weights_and_keeps_groups_per_version(tmp_path: Path):
    out = tmp_path / "trials.json"
    done = subprocess.run([sys.executable, "bench/rigor_live.py", "--trials", str(TRIALS), "--window", str(WINDOW),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = json.loads(out.read_text())
    assert len(trials) == TRIALS and f"live A/B: {TRIALS} real null swaps" in done.stdout
    for trial in trials:
        new = trial["to_version"]
        steps = trial["steps"]
        assert len(steps) == WINDOW and all(s > trial["swap_step"] for s in steps)
        assert trial["verdict"]["test"].startswith("HAC t-test")
        # Per-version groups: no group trained at a judged step mixed versions, and both versions trained.
        assert {str(s): 0.0 for s in steps} == {str(s): v for s, v in trial["mixed_groups"].items()}
        trained = {v for versions in trial["trained_versions"].values() for v in versions}
        assert new in trained and len(trained) == 2, trial["trained_versions"]
        # Paired tasks on the same weights: each compared pair is one (task, weights) cell both versions reached.
        pairs = [p for p in trial["pairs"] if new in p["episodes"]]
        assert pairs, trial["pairs"]
        for pair in pairs:
            assert len(pair["episodes"]) == 2 and all(pair["episodes"].values()), pair
            assert pair["task_id"] and len(pair["weights"]) == 1, pair  # one model: the version both opened on
            model, version = pair["weights"][0]
            assert model == "policy" and version >= 0
        # A null change is not kept unless a second, unseen window confirmed it (rare: the bench measures it).
        assert trial["kept"] != new or (trial["confirmation"] and trial["confirmation"]["result"] == "better")
