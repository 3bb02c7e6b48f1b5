"""A judged sandbox's judge as files, read statically: which paths no study proposal may change.

A study that edits code decides only on the scores a sandbox's judge computes in the server (DESIGN
§3.7: `judge = "judge.py"` in sandbox.toml, loaded by the core's `core.sandbox.judge`). The judge is
only a yardstick if no proposal can move it, so `judge_paths` names, relative to the sandbox folder,
everything it is made of: `sandbox.toml` (which names it), the judge file, and every module its
imports reach inside the folder, followed file to file with `ast` (nothing is imported or run). A
name the judge imports counts whether or not a file of that name exists yet: a proposal that adds
`string.py` beside a judge that imports `string` would be imported in its place. A string literal in
those files that names a file of the folder (a task list the judge reads) is protected too. An
import the source does not spell out (`importlib.import_module(name)`) cannot be seen: a judge
should import what it uses.

It reads files only; the brief check (`researcher.brief.loader`) and the workspace's path rules
(`researcher.code.workspace`) use it. It does not load or run a judge.
"""

from __future__ import annotations

import ast
import importlib.machinery
import tomllib
from pathlib import Path, PurePosixPath

TOML = "sandbox.toml"
JUDGE_KEY = "judge"  # the key naming the judge file, as in the core's sandbox contract
# Every file-name suffix Python imports a module from on this interpreter (extensions, source, bytecode).
IMPORT_SUFFIXES = tuple(importlib.machinery.all_suffixes())


def judge_name(folder: Path) -> str | None:
    """The judge file a sandbox folder's sandbox.toml names (None: no sandbox.toml, or no judge in it, or
    a sandbox.toml that does not parse)."""
    path = folder / TOML
    if not path.is_file():
        return None
    try:
        name = tomllib.loads(path.read_text()).get(JUDGE_KEY)
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
        return None
    return name if isinstance(name, str) and name else None


def judge_paths(folder: Path) -> list[str]:
    """Folder-relative POSIX paths (files, or folders meaning everything under them) that make up the
    sandbox's judge; [] for an unjudged sandbox."""
    name = judge_name(folder)
    if name is None:
        return []
    out = [TOML, name]
    todo, seen = [folder / name], set()
    while todo:
        source = todo.pop()
        if source in seen or not source.is_file():
            continue
        seen.add(source)
        try:
            tree = ast.parse(source.read_text(), str(source))
        except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
            continue  # a judge that does not parse fails when the server loads it; nothing more to follow here
        for module in _imported(tree):
            for candidate in (f"{module}.py", module):
                if candidate not in out:
                    out.append(candidate)
            package = folder / module
            todo += [folder / f"{module}.py", *sorted(package.rglob("*.py"))] if package.is_dir() else [folder / f"{module}.py"]
        for literal in _file_literals(tree, folder):
            if literal not in out:
                out.append(literal)
    return out


def _imported(tree: ast.Module) -> list[str]:
    """The top-level module names a file imports absolutely (`a` of `import a.b` and `from a.b import c`)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return list(dict.fromkeys(names))


def _file_literals(tree: ast.Module, folder: Path) -> list[str]:
    """String literals that name an existing file or folder of the sandbox folder (relative, inside it)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and 0 < len(node.value) < 256:
            rel = PurePosixPath(node.value)
            if rel.is_absolute() or ".." in rel.parts or "\0" in node.value or "\n" in node.value:
                continue
            try:
                exists = (folder / rel).exists()
            except (OSError, ValueError):
                continue
            if exists and str(rel) not in (".", ""):
                out.append(str(rel))
    return out


def shadows(inner: str, paths: list[str]) -> bool:
    """Whether a file at `inner` (relative to a judged sandbox folder) is, or could be imported as, part of the
    judge whose `judge_paths` are `paths`. The rule goes by import resolution, not by file name: Python imports
    `reward` from `reward.py`, but first from `reward.cpython-311-x86_64-linux-gnu.so` or `reward.so`, and also
    from `reward.pyc` or a `reward/` folder, and trusts an unchecked `__pycache__/reward.*.pyc` over the source;
    a `.pth` file runs code wherever the folder is a site directory. So: a listed path or anything under it, a
    listed name with any suffix of `importlib.machinery.all_suffixes()`, anything under `__pycache__/`, any
    `.pth`."""
    parts = PurePosixPath(inner).parts
    if not parts or "__pycache__" in parts or inner.endswith(".pth"):
        return bool(parts)
    for path in paths:
        if inner == path or inner.startswith(path + "/"):
            return True
        stem = path.removesuffix(".py")
        if len(parts) == 1 and any(inner == stem + suffix for suffix in IMPORT_SUFFIXES):
            return True
    return False


def protected_by_judge(rel: str, judged: dict[str, list[str]]) -> str | None:
    """The sandbox folder whose judge `rel` (a path relative to the project or workspace) is part of, or
    could be imported as part of (`shadows`), else None. `judged`: sandbox folder (relative) -> its
    `judge_paths`."""
    for folder, paths in judged.items():
        if rel.startswith(folder + "/") and shadows(rel[len(folder) + 1:], paths):
            return folder
    return None


def sandboxes_under(root: Path) -> list[Path]:
    """Every sandbox folder under `root` (a folder holding a sandbox.toml or an agent.py), `.git` left out."""
    found = {p.parent for pattern in (TOML, "agent.py") for p in root.rglob(pattern) if ".git" not in p.parts}
    return sorted(found)


def reached_sandboxes(rel: str, root: Path) -> list[Path]:
    """The sandbox folders an editable path reaches: the one it lies in (its nearest parent that is a sandbox
    folder, itself included) and, for a folder, every sandbox folder under it."""
    path = root / rel
    for parent in [path, *path.parents]:
        if parent == root.parent or not parent.is_relative_to(root):
            break
        if (parent / TOML).is_file() or (parent / "agent.py").is_file():
            return [parent]
    return sandboxes_under(path) if path.is_dir() else []


def unjudged(editable: list[str], root: Path) -> list[tuple[int, str]]:
    """(index in `editable`, why) for each editable path that reaches no sandbox, or an unjudged one: a study
    that edits code needs a judged sandbox to decide on."""
    problems = []
    for i, rel in enumerate(editable):
        folders = reached_sandboxes(rel, root)
        if not folders:
            problems.append((i, f"{rel} holds no sandbox (a folder with sandbox.toml and agent.py), so nothing "
                                "would judge the code it changes"))
        for folder in folders:
            name = judge_name(folder)
            where = folder.relative_to(root)
            if name is None:
                problems.append((i, f"sandbox {where} has no judge: a study that edits code decides only on scores "
                                    f"its judge computes, so {where}/{TOML} must name one (judge = \"judge.py\": "
                                    "tasks(split), score(task, episode), FAILURE; DESIGN §3.7)"))
            elif not (folder / name).is_file():
                problems.append((i, f"sandbox {where}: its judge {name} (named in {TOML}) does not exist"))
    return problems
