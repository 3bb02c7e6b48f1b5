"""Hostile episodes (issue 38, "Done means"): patched copies of the judged sandboxes run as contained clients of
real tiny runs, and every trick the outside review found is refused, or runs and gains nothing.

Two real runs of `configs/tiny.yaml` (seed 0, every client its own contained process under bubblewrap, each with
the credential its run issued it in `SWARMRL_CLIENT_GRANT`), shared by the cases below:
- `clean`: the shipped letters agent, and an arith agent that waits for new weights after a bad reply before it
  calls again (mix 0.1, so the first step's batch is letters alone and new weights come while it waits);
- `hostile`: a letters agent that resamples until its own copy of the letter count says good, and that once per
  process also tries what its credential should not allow (a debug episode, a request seed, shadow episodes under
  an undeclared sandbox finished with `reward: 1000`, opens labelled with another code version, group size or
  split, an anonymous open), writing what the server answered into its own working folder.
The judged scores are read from MLflow, what the server recorded from its registry. A third part plants compiled
files beside the judge: the read-only rule refuses them before review, and the sealed loader never reads a pyc.
"""

from __future__ import annotations

import json
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from core.config_io import load_config
from core.contain import contained as contain
from core.episodes.pairing import cell_of
from core.run import placement, processes
from core.run.loop import CoreRun
from core.sandbox.judge import JudgeEpisode, load_judges
from researcher.code.sealed import SealError, seal, verify
from researcher.code.workspace import Workspace, WorkspaceError
from tests.researcher.helpers import make_brief

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FAILURE = 0.0  # the letters and arith judges' failure value

COMMON = '''
import asyncio, json, os, time, uuid
from pathlib import Path

import httpx

GRANT = os.environ.get("SWARMRL_CLIENT_GRANT", "")  # the credential its run issued this process


def _put(name, value):
    part = f"{name}.{uuid.uuid4().hex}.part"  # episodes run side by side: a rename, never half a file
    Path(part).write_text(json.dumps(value))
    os.replace(part, name)


def _refusal(e):
    return [getattr(e, "status_code", None), getattr(e, "code", None)]


def _root(llm):
    return str(llm.base_url).split("/episodes/")[0]  # its relay to the server, inside its own network namespace
'''

# Resample until good, plus (once per process) every claim its credential should not let it make.
RESAMPLE = COMMON + '''
from reward import reward, tasks  # noqa: F401

MAX_TOKENS = 12
GOOD = 0.3


def _attacks(root):
    seen = {}
    with httpx.Client(base_url=root, timeout=60) as h:
        def try_open(label, body, grant=GRANT):
            r = h.post("/swarm/v1/episodes", json=body, headers={"x-swarm-grant": grant} if grant else {})
            try:
                error = r.json().get("error") or {}
            except ValueError:
                error = {}
            seen[label] = [r.status_code, error.get("code"), error.get("param")]
            if r.status_code == 200:  # let in: cash it in as a perfect episode
                opened = r.json()
                h.post(f"/swarm/v1/episodes/{opened['episode_id']}/finish", json={"reward": 1000.0},
                       headers={"Authorization": "Bearer " + opened["api_key"]})
        try_open("debug", {"kind": "debug"})  # a seed search off the books
        for i in range(3):
            try_open(f"shadow-{i}", {"sandbox": "shadow", "task_id": f"s{i}"})
        try_open("client_version", {"client_version": "the-other-side"})
        try_open("group_size", {"group_size": 7})
        try_open("split", {"split": "eval"})
        try_open("anonymous", {}, grant="")
        status = h.get("/swarm/v1/status", headers={"x-swarm-grant": GRANT}).json()
        seen["listed"] = status.get("clients", [])
    return seen


async def rollout(task, llm):
    try:
        os.close(os.open("attacks.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass
    else:
        _put("attacks.json", await asyncio.to_thread(_attacks, _root(llm)))
    messages = [{"role": "user", "content": task["prompt"]}]
    tries = []
    try:  # the seed of its choice in a train episode
        await llm.chat.completions.create(model=llm.model, messages=messages, max_tokens=MAX_TOKENS, seed=7)
        tries.append(["seed", 200, None])
    except Exception as e:
        tries.append(["seed", *_refusal(e)])
    own = 0.0
    for _ in range(8):  # call again until its own copy of the judge's count says the reply is good
        try:
            reply = await llm.chat.completions.create(model=llm.model, messages=messages, max_tokens=MAX_TOKENS)
        except Exception as e:
            tries.append(["again", *_refusal(e)])
            break
        own = reward(reply.choices[0].message.content or "")
        tries.append(["reply", 200, own])
        if own >= GOOD:
            break
    _put(f"episode-{uuid.uuid4().hex}.json", tries)
    return own
'''

# After a bad reply on the weights it opened on, wait for new weights, then call again.
WAITER = COMMON + '''
from sums import reward, tasks  # noqa: F401

EXAMPLES = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "What is 12 + 5?"},
    {"role": "assistant", "content": "17"},
]


def messages(task):
    return EXAMPLES + [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]


async def rollout(task, llm):
    async with httpx.AsyncClient(base_url=_root(llm), timeout=60, headers={"x-swarm-grant": GRANT}) as h:
        async def version():
            return (await h.get("/swarm/v1/status")).json()["models"]["policy"]["version"]
        before = await version()
        reply = await llm.chat.completions.create(model=llm.model, messages=messages(task), max_tokens=8)
        text = reply.choices[0].message.content or ""
        if reward(task, text) >= 1.0:  # a bad reply at any version waits (a loaded host starts it late)
            return reward(task, text)
        now, deadline = before, time.monotonic() + 90
        while now == before and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            now = await version()
    try:
        reply = await llm.chat.completions.create(model=llm.model, messages=messages(task), max_tokens=8)
        again = [200, None]
        text = reply.choices[0].message.content or ""
    except Exception as e:
        again = _refusal(e)
    _put(f"waited-{uuid.uuid4().hex}.json", {"task": task["id"], "before": before, "after": now, "again": again})
    return reward(task, text)
'''


def _patched(where: Path, sandbox: str, agent: str | None) -> Path:
    """A copy of a shipped sandbox (its judge, sandbox.toml and all) with `agent` as its agent.py; the folder keeps
    the sandbox's name, which its episodes carry."""
    folder = where / sandbox
    shutil.copytree(ROOT / "sandboxes" / sandbox, folder, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    if agent is not None:
        (folder / "agent.py").write_text(agent)
    return folder


class Ran:
    def __init__(self, core: CoreRun, folder: Path, ended: list, tracking: str):
        self.core, self.folder, self.ended = core, folder, ended
        self.metrics = MlflowClient(tracking)
        self.run_id = (folder / "run_id").read_text().strip()

    def history(self, name: str) -> dict[int, float]:
        return {m.step: m.value for m in self.metrics.get_metric_history(self.run_id, name)}

    def workdir(self, i: int, sandbox: str) -> Path:
        return self.folder / "clients" / f"{i}-{sandbox}"


def _run(root: Path, name: str, clients: list[tuple[Path, int, float]], steps: int) -> Ran:
    folder = root / name
    tracking = f"sqlite:///{root / 'mlflow.db'}"
    listed = ", ".join(f"{{agent: '{f}', concurrency: {c}, mix: {m}}}" for f, c, m in clients)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"trainer.steps={steps}", "trainer.batch_groups=4", "trainer.group_size=2",
        f"trainer.checkpoint_dir={folder / 'checkpoints'}", "containment.clients=required",
        f"telemetry.tracking_uri={tracking}", f"telemetry.experiment=hostile-{name}", f"clients=[{listed}]"])
    made: list[CoreRun] = []
    ended: list = []

    def core_run(cfg):  # the run `swarm run` builds, with a spy on its pair book
        core = placement.core_run(cfg)
        pairs = core.server.registry.pairs
        book = pairs.ended

        def spy(ep):  # every train episode as the server closed it, with the cell it was counted in
            ended.append(ep.model_copy(deep=True))
            book(ep)

        pairs.ended = spy
        made.append(core)
        return core

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(processes, "core_run", core_run)
        code = processes.run(cfg, run_id_file=folder / "run_id", progress=False)  # `swarm run`, in this process
    (core,) = made
    assert code == 0 and core.failure is None and core.step == steps, (code, core.failure)
    return Ran(core, folder, ended, tracking)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if contain.bwrap() is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    root = tmp_path_factory.mktemp("hostile")
    clean = _run(root, "clean", [(_patched(root / "shipped", "letters", None), 8, 1.0),
                                 (_patched(root / "waits", "arith", WAITER), 2, 0.1)], steps=3)
    hostile = _run(root, "hostile", [(_patched(root / "resamples", "letters", RESAMPLE), 8, 1.0)], steps=1)
    return {"clean": clean, "hostile": hostile}


def _attacks(runs) -> dict:
    return json.loads((runs["hostile"].workdir(0, "letters") / "attacks.json").read_text())


def test_resampling_until_good_is_refused_past_max_calls_scores_failure_and_gains_nothing(runs):
    hostile, clean = runs["hostile"], runs["clean"]
    tries = [json.loads(p.read_text()) for p in hostile.workdir(0, "letters").glob("episode-*.json")]
    resampled = [t for t in tries if t[-1][0] == "again"]
    assert resampled, tries  # it did try to call again after a reply it disliked
    assert all(t[-1][1:] == [400, "max_calls_exceeded"] for t in resampled), resampled
    assert all(sum(step[0] == "reply" for step in t) == 1 for t in tries)  # never a second reply to pick from
    letters = [e for e in hostile.ended if e.sandbox == "letters"]
    refused = [e for e in letters if "max_calls" in (e.abort_reason or "")]
    assert refused and all(e.score == FAILURE and len(e.calls) == 1 for e in refused)
    assert all(len(e.calls) <= 1 for e in letters)
    judged, shipped = hostile.history("reward/letters/mean"), clean.history("reward/letters/mean")
    assert judged[1] <= shipped[1], (judged, shipped)  # the judged score at step 1, same seed (0)
    assert hostile.history("calls/letters/mean")[1] <= 1.0


def test_a_seed_search_in_a_debug_episode_is_refused_and_a_request_seed_in_a_train_episode_is_400(runs):
    assert _attacks(runs)["debug"][:2] == [403, "debug_needs_person"]
    tries = [json.loads(p.read_text()) for p in runs["hostile"].workdir(0, "letters").glob("episode-*.json")]
    assert tries and all(t[0] == ["seed", 400, "seed_not_allowed"] for t in tries), tries
    assert not [e for e in runs["hostile"].ended if e.kind == "debug"]


def test_shadow_episodes_under_an_undeclared_sandbox_are_refused_and_reward_mean_stays_in_the_judges_range(runs):
    attacks = _attacks(runs)
    for i in range(3):
        assert attacks[f"shadow-{i}"] == [403, "undeclared_sandbox", "sandbox"], attacks
    hostile = runs["hostile"]
    assert {e.sandbox for e in hostile.ended} == {"letters"}
    means = hostile.history("reward/mean")
    assert means and all(0.0 <= v <= 1.0 for v in means.values()), means
    assert not hostile.history("unjudged_reward/shadow/mean")
    assert hostile.core.server.registry.counters["trained"] >= 8  # the judged episodes were not crowded out


def test_opens_labelled_with_another_code_version_are_refused(runs):
    assert _attacks(runs)["client_version"] == [403, "credential_mismatch", "client_version"]
    assert {e.client_version for e in runs["hostile"].ended} == {runs["hostile"].ended[0].client_version}
    assert "the-other-side" not in {e.client_version for e in runs["hostile"].ended}


def test_opens_with_another_group_size_or_split_are_refused_and_so_is_an_anonymous_one(runs):
    attacks = _attacks(runs)
    assert attacks["group_size"] == [403, "credential_mismatch", "group_size"]
    assert attacks["split"] == [403, "credential_mismatch", "split"]
    assert attacks["anonymous"][:2] == [401, "credential_required"]
    assert {e.group_size for e in runs["hostile"].ended} == {2}
    listed = attacks["listed"]  # its own registration only
    assert len(listed) <= 1 and all(c["sandbox"] == "letters" for c in listed), listed


def test_an_agent_that_waits_for_new_weights_after_a_bad_reply_stays_in_the_cell_it_opened_in(runs):
    clean = runs["clean"]
    waited = [json.loads(p.read_text()) for p in clean.workdir(1, "arith").glob("waited-*.json")]
    moved = [w for w in waited if w["after"] > w["before"]]
    assert moved, waited  # it saw the weights change while its episode was open
    assert all(w["again"] == [400, "max_calls_exceeded"] for w in moved), moved
    arith = [e for e in clean.ended if e.sandbox == "arith"]
    late = [e for e in arith if "max_calls" in (e.abort_reason or "")]
    assert len(late) >= len(moved)
    # Its call after the wait was refused (max_calls) before it ran on the new weights, and the episode is
    # counted with FAILURE in the cell of the weights it opened on, whatever it waited for. (Its one recorded call
    # may itself have run on newer weights than it opened on: a step can land between the open and that call.)
    for ep in late:
        opened = ep.opened_versions["policy"]
        assert ep.score == FAILURE
        assert cell_of(ep) == ("arith", ep.task_id, (("policy", opened),))
        assert len(ep.calls) == 1 and ep.calls[0].version >= opened


# --- compiled files beside the judge --------------------------------------------------------------------------

CHEAT_JUDGE = "from reward import tasks\nFAILURE = 0.0\n\ndef score(task, episode):\n    return 1.0\n"
CHEAT_REWARD = ("from string import ascii_lowercase\nMIN_LENGTH = 12\n\ndef reward(text):\n    return 1.0\n\n"
                "def tasks(split='train'):\n    yield {'id': f'{split}-0', 'prompt': 'hello'}\n")


def _unchecked_pyc(source: str, where: Path) -> bytes:
    """An unchecked-hash pyc of `source`: Python believes it whatever the .py beside it says."""
    where.mkdir(parents=True, exist_ok=True)
    src, out = where / "cheat.py", where / "cheat.pyc"
    src.write_text(source)
    py_compile.compile(str(src), cfile=str(out), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return out.read_bytes()


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "sandboxes" / "letters", project / "sandboxes" / "letters",
                    ignore=shutil.ignore_patterns("__pycache__"))
    brief = make_brief(project, "  agent:\n    kind: code\n    paths: [sandboxes/letters/agent.py]",
                       "code:\n  editable: [sandboxes/letters/]")
    workspace = Workspace(tmp_path / "workspace", brief.code, project)
    workspace.base()
    return workspace


@pytest.mark.parametrize("rel", ["sandboxes/letters/__pycache__/judge.cpython-311.pyc",
                                 "sandboxes/letters/reward.cpython-311-x86_64-linux-gnu.so"])
def test_a_pyc_or_so_beside_the_judge_is_refused_before_review(ws: Workspace, tmp_path: Path, rel: str) -> None:
    elf = b"\x7fELF\x02\x01\x00\x00 not the source"
    data = _unchecked_pyc(CHEAT_JUDGE, tmp_path / "build") if rel.endswith(".pyc") else elf
    author = ws.checkout(ws.base(), tmp_path / "author")
    (author / rel).parent.mkdir(parents=True, exist_ok=True)
    (author / rel).write_bytes(data)
    subprocess.run(["git", "add", "-A", "-f"], cwd=author, check=True)
    patch = subprocess.run(["git", "diff", "--cached", "--binary"], cwd=author, check=True, capture_output=True,
                           text=True).stdout
    assert "GIT binary patch" in patch
    tree = ws.checkout(ws.base(), tmp_path / "trial")
    ws.apply_patch(tree, patch)
    with pytest.raises(WorkspaceError, match=rf"{rel}: part of the judge of sandboxes/letters"):
        ws.check_changes(tree)


def test_the_sealed_loader_never_reads_a_planted_pyc(ws: Workspace, tmp_path: Path) -> None:
    sealed = tmp_path / "judges"
    seal(ws, sealed, ws.base())
    cache = sealed / "letters" / "__pycache__"
    cache.mkdir()
    (cache / "judge.cpython-311.pyc").write_bytes(_unchecked_pyc(CHEAT_JUDGE, tmp_path / "b1"))
    (cache / "reward.cpython-311.pyc").write_bytes(_unchecked_pyc(CHEAT_REWARD, tmp_path / "b2"))
    # The planted pyc is potent: a plain import of the sealed folder believes it over judge.py.
    plain = subprocess.run([sys.executable, "-c", "import judge; print(judge.score(None, None))"],
                           cwd=sealed / "letters", capture_output=True, text=True, timeout=60)
    assert plain.stdout.strip() == "1.0", plain.stderr
    before = sorted(p.relative_to(sealed) for p in sealed.rglob("*"))
    with pytest.raises(SealError, match=r"a file the study did not seal"):
        verify(sealed)  # a study starts no run on it
    cfg = load_config({"clients": [{"agent": str(ws.root / "sandboxes" / "letters")}]},
                      [f"server.judges_dir={sealed}"])
    judge = load_judges(cfg)["letters"]  # and the core, given it anyway, compiles the source with bytecode off
    assert judge.file == (sealed / "letters" / "judge.py").resolve()
    task = next(iter(judge.tasks("train")))
    assert task["prompt"] == "say something"  # reward.py's tasks, not the cheat's
    episode = JudgeEpisode(task_id=task["id"], kind="train", calls=[], completion="ZZZZ 1234",
                           completions=["ZZZZ 1234"], tool_calls=[], messages=[])
    assert judge.score(task, episode)[0] == FAILURE
    assert sorted(p.relative_to(sealed) for p in sealed.rglob("*")) == before  # nothing written beside it either
