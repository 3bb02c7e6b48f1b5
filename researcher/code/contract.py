"""The sandbox contract, read and not run: the entry defines `tasks` and `async def rollout(task, llm)`.

The static `contract` step of validation (researcher/code/validation.py) parses each edited
sandbox's entry file (sandbox.toml's `entry`, else agent.py) and asks `contract_problems` what the
entry's top level lacks: a `tasks` binding, or an `async def rollout` of two parameters (an import
of either counts; the executing `import` step checks what it is). It is deliberately not validation:
it runs no code, starts no process and records no step.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path


class ContractError(ValueError):
    """A sandbox whose contract cannot even be read (its sandbox.toml is not TOML)."""


def contract_problems(module: ast.Module) -> list[str]:
    """What a parsed entry lacks of the contract, one phrase each (empty: it keeps the contract)."""
    found = top_level(module)
    problems = []
    if "tasks" not in found:
        problems.append("it defines no tasks(split)")
    rollout = found.get("rollout")
    if rollout is None or isinstance(rollout, ast.FunctionDef):
        problems.append("it defines no `async def rollout(task, llm)`")
    elif isinstance(rollout, ast.AsyncFunctionDef) and len(rollout.args.args) + len(rollout.args.posonlyargs) != 2:
        problems.append("rollout must take (task, llm)")
    return problems


def entry_name(folder: Path) -> str:
    """The sandbox's entry file: sandbox.toml's `entry`, else agent.py."""
    try:
        meta = tomllib.loads((folder / "sandbox.toml").read_text()) if (folder / "sandbox.toml").is_file() else {}
    except tomllib.TOMLDecodeError as e:
        raise ContractError(f"{folder.name}/sandbox.toml: {e}") from None
    return str(meta.get("entry", "agent.py"))


def top_level(module: ast.Module) -> dict[str, ast.AST]:
    """Names bound at a module's top level -> the statement binding them (last one wins)."""
    found: dict[str, ast.AST] = {}
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                found[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    found[t.id] = node
    return found
