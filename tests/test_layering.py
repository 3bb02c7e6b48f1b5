"""Imports run one way: the core's packages by layer, Ray behind placement, the researcher on the core's public surface.

The layering (core/__init__.py, docs/architecture.md), top to bottom; a module may import its own
package, the packages below it and the foundation, never one above:
    run > ray > serve > clients > contain > episodes > sandbox > train > engine > foundation
Imports inside functions count (moving an import into a function does not change who depends on
whom); imports under `if TYPE_CHECKING:` do not. The checker is ast-only: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["run", "ray", "serve", "clients", "contain", "episodes", "sandbox", "train", "engine"]
FOUNDATION = {"core", "core.config", "core.config_io", "core.models", "core.records", "core.local_state", "core.mlflow_history"}
# Ray's driver builds its run on the loop and raises the plan's error; the modules above it in run/
# (placement, the processes, the command) are the ones that must not be reached from ray/.
RAY_MAY_USE = {"core.run.loop", "core.run.plan", "core.run.checkpoint"}
RAY_GATE = "core.run.placement"  # the one module that may import core.ray, and only inside a function
# The researcher validates search-space keys against the run config (`load_config`, `ConfigError`), keeps
# credentials from proposal code (`is_secret`) and diffs configs (`flatten`), so it needs the config's
# schema and its reading and writing (core.config_io, split from core.config by size, not by audience);
# and it reads runs back from MLflow. Nothing else of the core.
RESEARCHER_MAY_USE = {"core.config", "core.config_io", "core.mlflow_history"}
# researcher/ by tier, top to bottom (researcher/__init__.py): a package imports its own modules, the
# tiers below it and the foundation; packages of one tier do not import each other.
RESEARCHER_TIERS = [{"cli"}, {"study"}, {"review", "runs", "planner"}, {"code", "evidence"}]
RESEARCHER_FOUNDATION = {"researcher", "researcher.records", "researcher.brief", "researcher.budget", "researcher.lazy"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import of `path` outside TYPE_CHECKING blocks."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend((f"{node.module}.{a.name}", in_function) for a in node.names)
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def graph(root: Path) -> dict[str, list[tuple[str, bool]]]:
    """Each of our modules -> the modules of ours it imports (a `from pkg import name` resolves to pkg.name or pkg)."""
    files = {module_name(p, root): p for top in ("core", "researcher") for p in (root / top).rglob("*.py")}
    edges: dict[str, list[tuple[str, bool]]] = {}
    for mod, path in files.items():
        edges[mod] = []
        for target, lazy in imports(path):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != mod and not mod.startswith(target + "."):
                edges[mod].append((target, lazy))
    return edges


def researcher_tier(mod: str) -> tuple[int, str] | None:
    """(tier index, package) of a researcher module; None for the foundation."""
    parts = mod.split(".")
    if parts[0] != "researcher" or len(parts) < 2 or ".".join(parts[:2]) in RESEARCHER_FOUNDATION:
        return None
    for i, tier in enumerate(RESEARCHER_TIERS):
        if parts[1] in tier:
            return i, parts[1]
    raise AssertionError(f"{mod}: researcher/{parts[1]} is in no tier of RESEARCHER_TIERS nor the foundation")


def researcher_violation(mod: str, target: str) -> str | None:
    if target.startswith("core"):
        return None if target in RESEARCHER_MAY_USE else f"{mod} -> {target}: the researcher uses only {sorted(RESEARCHER_MAY_USE)}"
    if not target.startswith("researcher"):
        return None
    mine, theirs = researcher_tier(mod), researcher_tier(target)
    if theirs is None or (mine is not None and mine[1] == theirs[1]):
        return None
    if mine is None:
        return f"{mod} -> {target}: the researcher's foundation imports only the foundation"
    if theirs[0] <= mine[0]:
        where = "sits above it" if theirs[0] < mine[0] else "is its peer"
        return f"{mod} -> {target}: researcher/{mine[1]} may not import researcher/{theirs[1]}, which {where}"
    return None


def layer(mod: str) -> int | None:
    """Index in LAYERS of a core module's package; None for the foundation and for non-core modules."""
    parts = mod.split(".")
    return LAYERS.index(parts[1]) if parts[0] == "core" and len(parts) > 1 and parts[1] in LAYERS else None


def violations(edges: dict[str, list[tuple[str, bool]]]) -> list[str]:
    bad = []
    for mod, targets in edges.items():
        for target, lazy in targets:
            if mod.startswith("researcher"):
                problem = researcher_violation(mod, target)
                if problem:
                    bad.append(problem)
                continue
            if not target.startswith("core"):
                continue
            if mod in FOUNDATION:
                if target not in FOUNDATION:
                    bad.append(f"{mod} -> {target}: the foundation imports only the foundation")
                continue
            mine, theirs = layer(mod), layer(target)
            if theirs is None or theirs == mine:
                continue
            if target.startswith("core.ray"):
                if mod != RAY_GATE or not lazy:
                    bad.append(f"{mod} -> {target}: only {RAY_GATE} imports core.ray, inside the function that needs it")
            elif mod.startswith("core.ray") and target.startswith("core.run"):
                if target not in RAY_MAY_USE:
                    bad.append(f"{mod} -> {target}: core.ray may use only {sorted(RAY_MAY_USE)} of core.run")
            elif theirs < mine:
                bad.append(f"{mod} -> {target}: {LAYERS[mine]}/ may not import {LAYERS[theirs]}/, which sits above it")
    return bad


def cycles(edges: dict[str, list[tuple[str, bool]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), function-level imports included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _ in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_the_core_and_researcher_import_only_downward() -> None:
    bad = violations(graph(ROOT))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_module_imports_go_round() -> None:
    found = cycles(graph(ROOT))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_core_package_says_what_it_owns_and_must_not_import() -> None:
    for pkg in LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / "core" / pkg / "__init__.py").read_text()))
        assert doc and "import" in doc, f"core/{pkg}/__init__.py needs a docstring naming what it may import"


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, list[tuple[str, bool]]]:
    for rel, text in {"core/__init__.py": "", "researcher/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return graph(tmp_path)


def test_a_planted_back_import_is_caught(tmp_path: Path) -> None:
    edges = _plant(tmp_path, {
        "core/serve/__init__.py": "", "core/serve/server.py": "",
        "core/engine/__init__.py": "", "core/engine/hf.py": "def f():\n    from core.serve import server\n",
    })
    assert violations(edges) == ["core.engine.hf -> core.serve.server: engine/ may not import serve/, which sits above it"]


def test_ray_outside_placement_and_researcher_internals_are_caught(tmp_path: Path) -> None:
    edges = _plant(tmp_path, {
        "core/ray/__init__.py": "", "core/ray/driver.py": "import core.run.processes\n",
        "core/run/__init__.py": "", "core/run/processes.py": "",
        "core/run/loop.py": "from core.ray import driver\n",
        "core/run/placement.py": "def f():\n    from core.ray.driver import x\n",
        "researcher/cli/main.py": "from core.run.loop import CoreRun\n",
    })
    assert sorted(violations(edges)) == sorted([
        "core.ray.driver -> core.run.processes: core.ray may use only "
        "['core.run.checkpoint', 'core.run.loop', 'core.run.plan'] of core.run",
        "core.run.loop -> core.ray.driver: only core.run.placement imports core.ray, inside the function that needs it",
        "researcher.cli.main -> core.run.loop: the researcher uses only ['core.config', 'core.config_io', 'core.mlflow_history']",
    ])


def test_a_planted_researcher_back_import_is_caught(tmp_path: Path) -> None:
    edges = _plant(tmp_path, {
        "researcher/records.py": "", "researcher/brief/__init__.py": "", "researcher/brief/schema.py": "",
        "researcher/cli/__init__.py": "", "researcher/cli/main.py": "",
        "researcher/study/__init__.py": "", "researcher/study/runner.py": "from researcher.records import X\n",
        "researcher/evidence/__init__.py": "",
        "researcher/evidence/decision.py": "def f():\n    from researcher.study import runner\n",
        "researcher/review/__init__.py": "", "researcher/review/report.py": "from researcher.runs import launcher\n",
        "researcher/runs/__init__.py": "", "researcher/runs/launcher.py": "from researcher.brief.schema import Brief\n",
        "researcher/code/__init__.py": "", "researcher/code/workspace.py": "import researcher.cli.main\n",
    })
    assert sorted(violations(edges)) == sorted([
        "researcher.evidence.decision -> researcher.study.runner: researcher/evidence may not import researcher/study, which sits above it",
        "researcher.review.report -> researcher.runs.launcher: researcher/review may not import researcher/runs, which is its peer",
        "researcher.code.workspace -> researcher.cli.main: researcher/code may not import researcher/cli, which sits above it",
    ])


def test_researcher_has_few_top_level_modules_and_every_package_says_its_job() -> None:
    top = [p for p in (ROOT / "researcher").glob("*.py")]
    assert len(top) <= 6, f"researcher/ top level: {sorted(p.name for p in top)}"
    for pkg in sorted({p for tier in RESEARCHER_TIERS for p in tier} | {"brief"}):
        doc = ast.get_docstring(ast.parse((ROOT / "researcher" / pkg / "__init__.py").read_text()))
        assert doc, f"researcher/{pkg}/__init__.py needs a docstring saying its one job"


def test_a_planted_cycle_is_caught_even_through_a_function_level_import(tmp_path: Path) -> None:
    edges = _plant(tmp_path, {
        "core/train/__init__.py": "", "core/train/a.py": "from core.train import b\n",
        "core/train/b.py": "def f():\n    from core.train import a\n",
    })
    assert cycles(edges) == [["core.train.a", "core.train.b"]]
