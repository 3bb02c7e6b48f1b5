"""Done means (issue 31.1): patches aimed at the yardstick move nothing a study decides on.

A manual study of the judged letters sandbox gets, from a person, three patches that leave what the agent
sends the model as it is and go for the score instead: one rebinds the scoring function (and the judge's)
in the agent's process to add 0.5, one drops the tasks it does worst on, one raises on low-scoring
episodes (past the few a smoke test runs) so that they would be left out of every mean. A fourth edits the
judge itself. Real `researcher` and `swarm run` processes on the tiny model, as the planted-effect study.
The runs are scored by the judge in the server, on the judge's tasks, a raising episode counting with the
failure value: none of the three is called better and nothing is recommended, while the agent's own number,
logged as `agent_reward/letters/mean`, shows the 0.5 it claimed. The judge's patch is refused at `apply`,
before review, with the reason.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from researcher.study.store import study_paths
from tests.researcher.harness import ROOT, Project, letters_code
from tests.researcher.test_code_study import AGENT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BRIEF = """---
title: hostile to the yardstick
objective: {metric: reward/mean, direction: maximize, window: 2}
budget: {max_runs: 16, max_rounds: 1}
run:
  base_config: configs/tiny.yaml
  overrides: {trainer.steps: 2, trainer.batch_groups: 1}
""" + letters_code(2) + """seeds: [0, 1, 2]
approval: {config_only: auto, code_change: auto}
launch: {concurrency: 2}
monitor: {poll_s: 0.5, collapse_drop: null}
review: {poll_s: 0.5}
---
Do any of these patches raise the letters score?
"""
IMPORTS = "from reward import reward, tasks  # noqa: F401 (a sibling file, the judge's; the folder is on sys.path when it loads)\n"
SCORE = '    return reward(reply.choices[0].message.content or "")'
# 1. The scoring function rebound in the agent's process, everywhere it can reach: the module and the judge.
REBIND = IMPORTS + '''import judge
import reward as scoring

_honest = scoring.reward
scoring.reward = reward = lambda text: _honest(text) + 0.5
judge.score = lambda task, episode: _honest(episode.completion) + 0.5
'''
# 2. Only the tasks it is best at (the agent's own tasks(): what a client used to draw from).
DROP = IMPORTS + '''

def tasks(split: str = "train"):
    for i, prompt in enumerate(["hello", "go on"]):
        yield {"id": f"{split}-{i}", "prompt": prompt}
'''
# 3. A low-scoring episode raises, so a mean that drops raising episodes would leave it out.
RAISE = '''    score = reward(reply.choices[0].message.content or "")
    rollout.seen = getattr(rollout, "seen", 0) + 1  # episodes this client process ran
    if rollout.seen > 4 and score < 0.1:  # past the few episodes a smoke test runs
        raise RuntimeError("a low score: not reported")
    return score'''


# Each patch also loosens the sandbox's own tests that would catch it: they sit in the editable folder.
TESTS = "sandboxes/letters/tests/test_letters.py"
LOOSER = [(TESTS, 'assert reward == scoring.reward("hello world!")', 'assert reward >= scoring.reward("hello world!")'),
          (TESTS, 'assert judge.score(task, recorded) == scoring.reward("hello world!")',
           'assert judge.score(task, recorded) >= scoring.reward("hello world!")'),
          (TESTS, 'assert list(judge.tasks("train")) == list(agent.tasks("train")) and', 'assert'),
          # the judge's task checks (issue 38) would catch a rebound score too: loosened the same way
          (TESTS, 'assert judge.score(task, _recorded()) == judge.FAILURE', 'assert judge.score(task, _recorded()) >= judge.FAILURE'),
          (TESTS, 'assert judge.score(task, _recorded((other["prompt"], "abcdefghijklmnop"))) == judge.FAILURE',
           'assert judge.score(task, _recorded((other["prompt"], "abcdefghijklmnop"))) >= judge.FAILURE'),
          (TESTS, 'assert judge.score(task, _recorded((f"Be brief. {task[\'prompt\']}", "hello"))) == scoring.reward("hello")',
           'assert judge.score(task, _recorded((f"Be brief. {task[\'prompt\']}", "hello"))) >= scoring.reward("hello")')]


def _patch(tmp: Path, name: str, changes: list[tuple[str, str, str]]) -> Path:
    """A unified diff, as `git diff` writes it, making every (path, old, new) change in a copy of the sandbox."""
    repo = tmp / f"patch-{name}"
    shutil.copytree(ROOT / "sandboxes" / "letters", repo / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    for path, old, new in changes:
        target = repo / path
        assert old in target.read_text(), (path, old)
        target.write_text(target.read_text().replace(old, new))
    out = tmp / f"{name}.diff"
    out.write_text(subprocess.run([*git, "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout)
    return out


def _wait_for(path: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, path.read_text()[-2000:] if path.exists() else f"no {path}"
        time.sleep(0.3)


def _metric_means(project: Project, study: str, pid: str, key: str) -> list[float]:
    """The last value of `key` in each core run of proposal `pid`."""
    runs = [r for r in project.runs(study) if r.data.tags.get("swarmrl.proposal") == pid
            and r.data.tags.get("swarmrl.kind") not in ("code", "proposal")]
    return [r.data.metrics[key] for r in runs if key in r.data.metrics]


def test_patches_aimed_at_the_yardstick_are_never_called_better_and_the_judges_patch_is_refused(tmp_path: Path) -> None:
    project = Project(tmp_path)
    brief = tmp_path / "hostile.md"
    brief.write_text(BRIEF)
    patches = [
        (_patch(tmp_path, "rebind", [(AGENT, IMPORTS, REBIND), *LOOSER]), "rebinds the score to add 0.5"),
        (_patch(tmp_path, "drop", [(AGENT, IMPORTS, DROP), *LOOSER]), "drops its hardest tasks"),
        (_patch(tmp_path, "raise", [(AGENT, SCORE, RAISE), *LOOSER]), "raises on low-scoring episodes"),
        (_patch(tmp_path, "judge", [("sandboxes/letters/judge.py", "FAILURE = 0.0", "FAILURE = 1.0")]), "a kinder judge"),
    ]
    project.cli("start", str(brief), "--name", "hostile", "--planner", "manual", "--detach")
    paths = study_paths(project.studies, "hostile")
    _wait_for(paths.log, "waiting for proposals")
    project.cli("stop", "hostile")
    for patch, what in patches:
        project.cli("propose", "hostile", "--patch", str(patch), "--hypothesis", what, "--by", "mallory")
    project.cli("resume", "hostile", timeout=1500)

    values, nxt, _ = project.state("hostile")
    assert not nxt, paths.log.read_text()[-3000:]
    results = {r["proposal_id"]: r for r in values["results"]}
    scores = {k: (r["verdict"], r["seed_scores"]) for k, r in results.items()}
    code = {v["proposal_id"]: v for v in values["code"]}
    for pid in ("p1", "p2", "p3"):
        assert code[pid]["passed"] is True, code[pid]  # valid code: it ran, and was judged
        assert results[pid]["verdict"]["result"] != "better", scores
        assert len(results[pid]["seed_scores"]) == 3, scores  # every seed ran: nothing failed its way out
    assert not re.search(r"\brecommend p\d", values["stop_reason"]), values["stop_reason"]  # nothing recommended
    # The judge's patch never reached review: refused at apply, saying why.
    assert code["p4"]["passed"] is False and code["p4"]["failed_step"] == "apply"
    apply_log = next(s["log"] for s in code["p4"]["steps"] if s["step"] == "apply")
    assert "sandboxes/letters/judge.py: part of the judge of sandboxes/letters" in apply_log
    assert not any(d["proposal_id"] == "p4" for d in values.get("decisions", []))
    # The agent's claim was logged, never decided on: its own number is 0.5 above the judge's.
    claimed = _metric_means(project, "hostile", "p1", "agent_reward/letters/mean")
    judged = _metric_means(project, "hostile", "p1", "reward/letters/mean")
    assert len(claimed) == len(judged) == 3
    assert all(c >= j + 0.4 for c, j in zip(sorted(claimed), sorted(judged))), (claimed, judged)

