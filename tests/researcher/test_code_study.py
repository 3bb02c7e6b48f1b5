"""Code experiments end to end: real `researcher` processes, real `swarm serve`/`client`/`run`, real MLflow.

Two studies on the tiny model and the letters sandbox:
- an llm study, with a scripted OpenAI-compatible server standing in for the remote LLM: it
  proposes a search/replace edit (validated, approved by an MLflow tag, run at its commit, scored,
  in the report's lineage with its diff) and an edit that does not match (sent back once with the
  file's text, then invalid at `apply`);
- a `--planner manual` study fed by `researcher study propose` (patches and `--set`), killed with
  -9 during a validation and resumed, with bad patches that end invalid at their step.
Neither may change anything in the project checkout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from researcher.review.views import proposal_view
from researcher.study.store import owner_pid, study_paths
from tests.researcher.harness import ROOT, Project
from tests.researcher.scripted_llm import ScriptedLLM, serve

# Each study validates code (a smoke run against `swarm serve`) and trains: minutes on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BRIEF = """---
title: code test
objective: {{metric: reward/mean, direction: maximize}}
budget: {{max_runs: 6, max_rounds: {rounds}}}
run:
  base_config: configs/tiny.yaml
  overrides: {{trainer.steps: 2, trainer.batch_groups: 1}}
search_space:
  agent: {{kind: code, paths: [sandboxes/letters/agent.py]}}
code:
  editable: [sandboxes/letters/]
  readonly: [sandboxes/letters/reward.py]
  smoke_model: tiny
  smoke_episodes: 2
  execute_before_review: {execute}
seeds: [0]
planner: {{llm: {{proposals_per_round: 3, max_retries: 1}}}}
monitor: {{poll_s: 0.5, collapse_drop: null}}
review: {{poll_s: 0.5}}
---
Does a longer reply budget change the letters reward?
"""
AGENT = "sandboxes/letters/agent.py"


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)


def _checkout_hash() -> str:
    """A hash of the project files a code study reads from and could touch by mistake."""
    digest = hashlib.sha256()
    files = [*(ROOT / "sandboxes").rglob("*"), *(ROOT / "configs").rglob("*"), *(ROOT / "studies").glob("*.md")]
    for f in sorted(files):
        if f.is_file() and not {"__pycache__", ".pytest_cache"} & set(f.parts):
            digest.update(str(f.relative_to(ROOT)).encode() + f.read_bytes())
    return digest.hexdigest()


def _patch(tmp: Path, name: str, path: str, old: str, new: str) -> Path:
    """A unified diff, as `git diff` writes it, changing `old` to `new` in a copy of the project file."""
    repo = tmp / f"patch-{name}"
    shutil.copytree(ROOT / "sandboxes" / "letters", repo / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    target = repo / path
    assert old in target.read_text()
    target.write_text(target.read_text().replace(old, new))
    out = tmp / f"{name}.diff"
    out.write_text(subprocess.run([*git, "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout)
    return out


def _show(project: Project, study: str, pid: str) -> dict:
    return json.loads(project.cli("show", study, pid, "--json").stdout)


def _wait_status(project: Project, study: str, pid: str, wanted: set[str], timeout: float = 900) -> dict:
    """The CLI's `show --json` of `pid` once its status is one of `wanted`. The wait reads the state
    in this process (a CLI process a second would compete with the study for the CPU); the answer
    comes from the CLI."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values, _, _ = project.state(study)
        view = proposal_view(values, pid) if values else None
        if view is not None and view.status in wanted:
            shown = _show(project, study, pid)
            assert shown["status"] in wanted, shown
            return shown
        time.sleep(1)
    log = study_paths(project.studies, study).log
    raise AssertionError(f"{pid} never reached {wanted}:\n{log.read_text()[-3000:] if log.exists() else ''}")


def _approve_by_tag(project: Project, study: str, pid: str) -> None:
    client = MlflowClient(project.tracking_uri)
    run = next(r for r in project.runs(study) if r.data.tags.get("swarmrl.proposal") == pid
               and r.data.tags.get("swarmrl.kind") == "code")
    client.set_tag(run.info.run_id, "review.by", "alice")
    client.set_tag(run.info.run_id, "review.status", "approved")


def _core_run_tags(project: Project, study: str, pid: str) -> list[dict[str, str]]:
    return [r.data.tags for r in project.runs(study)
            if r.data.tags.get("swarmrl.proposal") == pid and r.data.tags.get("swarmrl.kind") not in ("code", "proposal")]


def _edit(search: str, replace: str, priority: int) -> dict:
    return {"hypothesis": "a longer reply budget changes the reward", "rationale": "more letters per reply",
            "expected_effect": "reward moves", "priority": priority, "needs_code_change": True,
            "code_change": "agent: reply length", "edits": [{"file": AGENT, "search": search, "replace": replace}]}


def test_llm_code_proposal_is_validated_reviewed_run_at_its_commit_and_reported(project: Project) -> None:
    before = _checkout_hash()
    brief = project.tmp / "code.md"
    brief.write_text(BRIEF.format(rounds=1, execute="false"))
    # r1-3 imports a module that does not exist: only running it shows that, after approval.
    plan = json.dumps({"proposals": [_edit("MAX_TOKENS = 12", "MAX_TOKENS = 16", 1),
                                     _edit("MAX_TOKENS = 99", "MAX_TOKENS = 7", 2),
                                     _edit("MAX_TOKENS = 12", "MAX_TOKENS = 12\nimport no_such_module_anywhere", 3)]})
    llm = ScriptedLLM([plan, plan])  # the repair request gets the same unmatched block back
    with serve(llm) as url:
        project.cli("start", str(brief), "--name", "llm", "--planner", "llm", "--llm-base-url", url,
                    "--llm-model", "scripted", "--detach")
        good = _wait_status(project, "llm", "r1-1", {"pending", "invalid"})
        bad = _wait_status(project, "llm", "r1-2", {"invalid"})
        assert good["status"] == "pending", good["validation"]["log"]
        # Human approval: before review only the static checks ran; nothing of the proposal executed.
        assert "== contract: passed" in good["validation"]["log"] and "== import" not in good["validation"]["log"]
        assert "to come after approval: import, tests, smoke" in good["validation"]["log"]
        late = _wait_status(project, "llm", "r1-3", {"pending", "invalid"})
        assert late["status"] == "pending", late["validation"]["log"]
        assert "checks run: apply ok, compile ok, contract ok; to come after approval: import, tests, smoke" in \
            " ".join(project.cli("review", "llm").stdout.split())  # however the console wrapped it
        assert [good["validation"]["passed"], bad["validation"]["step"]] == [True, "apply"]
        assert "does not match" in bad["validation"]["log"] and bad["commit"] is None
        assert len(llm.requests) == 2
        repair = llm.requests[1]["messages"][-1]["content"]
        assert "does not match" in repair and "MAX_TOKENS = 12" in repair  # the file's current text goes back
        assert "MAX_TOKENS = 12" in llm.requests[0]["messages"][-1]["content"]  # editable files in the context
        proposal_run = next(r for r in project.runs("llm") if r.data.tags.get("swarmrl.proposal") == "r1-1"
                            and r.data.tags.get("swarmrl.kind") == "code")
        assert proposal_run.info.status == "SCHEDULED"
        artifacts = {a.path for a in MlflowClient(project.tracking_uri).list_artifacts(proposal_run.info.run_id, "proposal")}
        assert {"proposal/code.diff", "proposal/validation.log"} <= artifacts
        _approve_by_tag(project, "llm", "r1-1")
        _approve_by_tag(project, "llm", "r1-3")
        values = project.wait_done("llm")
    late = _show(project, "llm", "r1-3")  # approved, then its import failed: invalid, before any core run
    assert (late["status"], late["validation"]["step"], late["commit"]) == ("invalid", "import", None), late
    assert "no_such_module_anywhere" in late["validation"]["log"] and _core_run_tags(project, "llm", "r1-3") == []
    done = _show(project, "llm", "r1-1")
    assert done["status"] == "done" and done["score"] is not None
    assert [t["swarmrl.sandbox_version"] for t in _core_run_tags(project, "llm", "r1-1")] == [done["commit"]]
    assert [t["swarmrl.study"] for t in _core_run_tags(project, "llm", "r1-1")] == ["llm"]
    # The baseline rule gave the LLM's round its baseline (at the base commit, approved by policy), and
    # the code proposal a verdict against it.
    baseline = next(p for p in values["proposals"] if p["planner"] == "baseline")
    assert {d["proposal_id"]: (d["verdict"], d["by"]) for d in values["decisions"]} == \
        {"r1-1": ("approved", "alice"), "r1-3": ("approved", "alice"), baseline["id"]: ("approved", "policy")}
    verdict = next(r for r in values["results"] if r["proposal_id"] == "r1-1")["verdict"]
    assert verdict is not None and verdict["baseline"] == baseline["id"]
    diff = project.cli("diff", "llm", "r1-1").stdout
    assert "-MAX_TOKENS = 12" in diff and "+MAX_TOKENS = 16" in diff
    report = Path(values["report"]).read_text()
    row = next(line for line in report.splitlines() if line.startswith("| r1-1 |"))
    assert "[diff](diffs/r1-1.diff)" in row and done["commit"][:12] in row and "approved by alice" in row
    assert "invalid at apply" in next(line for line in report.splitlines() if line.startswith("| r1-2 |"))
    # The study keeps every core run's and smoke server's output: none holds the admin token, only its file.
    state = study_paths(project.studies, "llm").state
    logs = [*state.rglob("run.log"), *state.rglob("*.serve.log")]
    announced = [line for f in logs for line in f.read_text(errors="replace").splitlines() if "swarm admin token:" in line]
    assert {f.name for f in logs} >= {"run.log", "r1-1.serve.log"} and len(announced) >= 2, logs
    assert all(re.search(r"swarm admin token: in /\S+token, readable only by you$", line) for line in announced), announced
    assert _checkout_hash() == before


def test_manual_study_runs_peoples_proposals_survives_kill_9_and_refuses_bad_patches(project: Project) -> None:
    before = _checkout_hash()
    tmp = project.tmp
    brief = tmp / "manual.md"
    brief.write_text(BRIEF.format(rounds=5, execute="true"))  # opted in: the executing steps run before review
    paths = study_paths(project.studies, "man")
    good = _patch(tmp, "good", AGENT, "MAX_TOKENS = 12", "MAX_TOKENS = 16")
    project.cli("start", str(brief), "--name", "man", "--planner", "manual", "--detach")
    assert project.cli("propose", "man", "--patch", str(good), "--hypothesis", "longer replies").stdout \
        .strip().splitlines()[-1] == "p1"
    deadline = time.monotonic() + 300
    while not (paths.trials / "p1").exists():  # validation of p1 is under way
        assert time.monotonic() < deadline, paths.log.read_text()[-2000:]
        time.sleep(0.2)
    owner = owner_pid(paths)
    assert owner is not None and owner > 0  # never signal -1 (every process of ours)
    os.kill(owner, signal.SIGKILL)
    git = ["git", "-C", str(paths.workspace)]
    refs = subprocess.run([*git, "for-each-ref", "refs/proposals/"], capture_output=True, text=True).stdout
    assert refs == "" and subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout == ""
    project.cli("resume", "man", "--detach")
    view = _wait_status(project, "man", "p1", {"pending", "invalid"})
    assert view["status"] == "pending", view["validation"]["log"]
    assert project.cli("propose", "man", "--set", "trainer.lr=0.01", "--hypothesis", "a higher learning rate")\
        .stdout.strip().splitlines()[-1] == "p2"
    readonly = _patch(tmp, "readonly", "sandboxes/letters/reward.py", "MIN_LENGTH = 12", "MIN_LENGTH = 1")
    escape = tmp / "escape.diff"
    escape.write_text("--- a/sandboxes/letters/../../configs/tiny.yaml\n+++ b/sandboxes/letters/../../configs/tiny.yaml\n"
                      "@@ -1 +1 @@\n-# x\n+# y\n")
    # A bug only real episodes show (the sandbox's own test uses a stand-in model without base_url):
    # some episodes raise, the others return NaN.
    smoke = _patch(tmp, "smoke", AGENT, "    return reward(reply.choices[0].message.content or \"\")",
                   "    if hasattr(llm, \"base_url\"):\n        if task[\"id\"].endswith(\"0\"):\n"
                   "            raise RuntimeError(\"boom\")\n        return float(\"nan\")\n"
                   "    return reward(reply.choices[0].message.content or \"\")")
    ids = [project.cli("propose", "man", "--patch", str(p), "--hypothesis", f"bad {p.stem}").stdout.strip()
           .splitlines()[-1] for p in (readonly, escape, smoke)]
    assert ids == ["p3", "p4", "p5"]
    refused = project.cli("propose", "man", "--set", "no.such.key=1", "--hypothesis", "bad key", check=False)
    assert refused.returncode == 2 and "--set" in refused.stdout
    _approve_by_tag(project, "man", "p1")
    assert _wait_status(project, "man", "p1", {"done", "failed"})["status"] == "done"
    commit = _show(project, "man", "p1")["commit"]
    assert [t["swarmrl.sandbox_version"] for t in _core_run_tags(project, "man", "p1")] == [commit]
    for pid, step in (("p3", "apply"), ("p4", "apply"), ("p5", "smoke")):
        view = _wait_status(project, "man", pid, {"invalid", "pending"})
        assert (pid, view["status"], view["validation"]["step"], view["commit"]) == (pid, "invalid", step, None), \
            view["validation"]["log"]
    assert "reward.py: read-only" in _show(project, "man", "p3")["validation"]["log"]
    assert "'..' are refused" in _show(project, "man", "p4")["validation"]["log"]
    _wait_status(project, "man", "p2", {"pending"})
    project.cli("approve", "man", "p2")
    assert _wait_status(project, "man", "p2", {"done", "failed"})["status"] == "done"
    base = subprocess.run([*git, "rev-parse", "base"], capture_output=True, text=True).stdout.strip()
    assert [t["swarmrl.sandbox_version"] for t in _core_run_tags(project, "man", "p2")] == [base]
    refs = subprocess.run([*git, "for-each-ref", "--format=%(refname)", "refs/proposals/"], capture_output=True,
                          text=True).stdout.split()
    assert refs == ["refs/proposals/p1"]
    out = tmp / "p1-code"
    project.cli("checkout", "man", "p1", str(out))
    assert "MAX_TOKENS = 16" in (out / AGENT).read_text()
    project.cli("stop", "man")
    assert _checkout_hash() == before
