"""A sealed judge (`server.judges_dir`): the server loads every judge from the sealed copy a study gives it,
never from the sandbox folder a client runs, and loads it from source alone: no `__pycache__` read or written."""

from __future__ import annotations

import importlib.util
import py_compile
import sys
from pathlib import Path

from core.config import RunConfig
from core.sandbox.judge import JudgeEpisode, load_judge, load_judges

JUDGE = "from reward import points\nFAILURE = 0.0\n\ndef tasks(split):\n    yield {'id': split}\n\n" \
        "def score(task, episode):\n    return points(episode.completion)\n"
HONEST = "def points(text):\n    return 0.25\n"
CHEAT = "def points(text):\n    return 1.0\n"


def _sandbox(folder: Path, reward: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "sandbox.toml").write_text('name = "letters"\njudge = "judge.py"\n')
    (folder / "judge.py").write_text(JUDGE)
    (folder / "reward.py").write_text(reward)
    (folder / "agent.py").write_text("")
    return folder


def _score(judge) -> float:
    episode = JudgeEpisode(task_id="train", kind="train", calls=[], completion="x", completions=["x"],
                           tool_calls=[], messages=[])
    return judge.score({"id": "train"}, episode)[0]


def test_with_judges_dir_set_the_judge_comes_from_the_sealed_copy_not_the_clients_folder(tmp_path: Path) -> None:
    client = _sandbox(tmp_path / "checkout" / "sandboxes" / "letters", CHEAT)  # a proposal's checkout
    sealed = _sandbox(tmp_path / "sealed" / "letters", HONEST)
    cfg = RunConfig.model_validate({"clients": [{"agent": str(client)}], "server": {"judges_dir": str(tmp_path / "sealed")}})
    judge = load_judges(cfg)["letters"]
    assert judge.file == (sealed / "judge.py").resolve()
    assert _score(judge) == 0.25
    unsealed = RunConfig.model_validate({"clients": [{"agent": str(client)}]})
    assert _score(load_judges(unsealed)["letters"]) == 1.0  # without it, the client's folder (what a study must avoid)


def test_a_sandbox_with_nothing_sealed_under_its_name_gets_no_judge_from_its_own_folder(tmp_path: Path) -> None:
    client = _sandbox(tmp_path / "checkout" / "letters", CHEAT)
    (tmp_path / "sealed").mkdir()
    cfg = RunConfig.model_validate({"clients": [{"agent": str(client)}], "server": {"judges_dir": str(tmp_path / "sealed")}})
    assert load_judges(cfg) == {}


def test_a_planted_unchecked_pyc_beside_a_judge_module_is_never_read_and_none_is_written(tmp_path: Path) -> None:
    box = _sandbox(tmp_path / "letters", HONEST)
    # The attack of issue 38: an unchecked-hash pyc of a cheating reward.py, left where Python looks for it.
    cheat = tmp_path / "cheat" / "reward.py"
    cheat.parent.mkdir()
    cheat.write_text(CHEAT)
    cache = Path(importlib.util.cache_from_source(str(box / "reward.py")))
    py_compile.compile(str(cheat), cfile=str(cache), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    assert _score(load_judge(box)) == 0.25
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name]  # nothing written beside it
    cache.unlink()
    assert _score(load_judge(box)) == 0.25
    assert not any(cache.parent.iterdir())


def test_a_module_of_the_judges_name_already_imported_from_elsewhere_is_never_the_judges(tmp_path: Path) -> None:
    """A `reward` module another sandbox (or an in-process agent) imported before is in `sys.modules`: the
    judge still imports its own folder's file, and the other module is back in place afterwards."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "reward.py").write_text(CHEAT)
    spec = importlib.util.spec_from_file_location("reward", planted / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["reward"] = module
    try:
        assert _score(load_judge(_sandbox(tmp_path / "letters", HONEST))) == 0.25
        assert sys.modules["reward"] is module
    finally:
        del sys.modules["reward"]
