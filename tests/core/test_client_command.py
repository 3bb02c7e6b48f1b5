"""The `swarm client` command line is built in one place (`core.run.client_command.ClientSpec`), and the
command `core.run.cli` declares parses every option it builds back to the value it was given."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from core.run.cli import app
from core.run.client_command import CLI_MODULE, ClientSpec
from core.run.hotswap import inherited

ROOT = Path(__file__).resolve().parents[2]


def parsed(argv: list[str]) -> dict:
    """What `swarm client` receives from `argv` (after `python -m core.run.cli client`), as click parses it."""
    command = typer.main.get_command(app).commands["client"]
    with command.make_context("client", argv[4:]) as ctx:
        return ctx.params


def test_every_option_the_spec_builds_reaches_the_client_command_with_its_value(tmp_path):
    spec = ClientSpec(sys.executable, "sandbox:toy", "http://127.0.0.1:8000", concurrency=3, group_size=2,
                      kind="eval", client_id="toy-host-1", workdir=tmp_path / "w", split="test", tasks=7,
                      episode_timeout=12.5, seed="0/1", code_version="abc123def456")
    argv = spec.to_argv()
    assert argv[:4] == [sys.executable, "-m", CLI_MODULE, "client"]
    params = parsed(argv)
    assert params["sandbox"] == "sandbox:toy" and params["server"] == "http://127.0.0.1:8000"
    assert (params["concurrency"], params["group_size"], params["kind"], params["client_id"]) == (3, 2, "eval", "toy-host-1")
    assert (params["workdir"], params["split"], params["tasks"]) == (tmp_path / "w", "test", 7)
    assert (params["episode_timeout"], params["seed"], params["code_version"]) == (12.5, "0/1", "abc123def456")


def test_an_option_left_unset_is_not_passed_so_the_commands_default_holds():
    argv = ClientSpec("python", "agents.toy:run", "http://h:1").to_argv()
    assert argv == ["python", "-m", CLI_MODULE, "client", "agents.toy:run", "--server", "http://h:1"]
    params = parsed(argv)
    assert (params["concurrency"], params["kind"], params["split"], params["tasks"]) == (4, "train", "train", None)


def test_a_swapped_in_client_gets_the_old_ones_task_settings():
    old = {"split": "train", "seed": "0/1", "tasks": 50, "episode_timeout": 30.0, "kind": "train"}
    params = parsed(ClientSpec("python", "s", "http://h:1", **inherited(old)).to_argv())
    assert (params["split"], params["seed"], params["tasks"], params["episode_timeout"]) == ("train", "0/1", 50, 30.0)
    unset = parsed(ClientSpec("python", "s", "http://h:1", **inherited(
        {**old, "seed": None, "tasks": None, "episode_timeout": None, "split": None})).to_argv())
    assert (unset["split"], unset["seed"], unset["tasks"], unset["episode_timeout"]) == ("train", None, None, None)


def test_no_module_of_the_core_builds_the_client_command_line_by_hand():
    by_hand = [p.relative_to(ROOT) for p in sorted((ROOT / "core").rglob("*.py"))
               if '"client", ' in p.read_text() and '"-m"' in p.read_text() and p.name != "client_command.py"]
    assert by_hand == []
