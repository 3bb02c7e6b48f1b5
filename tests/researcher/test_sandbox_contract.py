"""The sandbox contract read from source (researcher/code/contract.py): nothing of the entry runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from researcher.code.contract import ContractError, contract_problems, entry_name


def test_an_entry_with_tasks_and_a_two_argument_async_rollout_keeps_the_contract() -> None:
    source = "from .data import tasks\nasync def rollout(task, llm):\n    return 1.0\n"
    assert contract_problems(ast.parse(source)) == []


def test_a_sync_rollout_and_missing_tasks_are_both_named() -> None:
    assert contract_problems(ast.parse("def rollout(task, llm):\n    pass\n")) == [
        "it defines no tasks(split)", "it defines no `async def rollout(task, llm)`"]
    assert contract_problems(ast.parse("tasks = []\nasync def rollout(task):\n    pass\n")) == [
        "rollout must take (task, llm)"]


def test_the_entry_comes_from_sandbox_toml_and_a_broken_toml_is_a_contract_error(tmp_path: Path) -> None:
    assert entry_name(tmp_path) == "agent.py"
    (tmp_path / "sandbox.toml").write_text('entry = "main.py"\n')
    assert entry_name(tmp_path) == "main.py"
    (tmp_path / "sandbox.toml").write_text("entry = \n")
    with pytest.raises(ContractError, match=r"sandbox.toml"):
        entry_name(tmp_path)
