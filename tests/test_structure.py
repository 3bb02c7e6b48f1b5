"""One package per process: the server side imports nothing of the agent side, and containment is a package of its own;
and the run signals through types, not through engine classes or metric names.

The layering itself (which package may import which) is tests/test_layering.py; these are the bars of
the structure it cannot express as an order: the server (`serve/`, `episodes/`, `sandbox/`) and the
agent side (`clients/`) run in different processes, so neither reaches into the other's modules. The
run and the server ask any engine what they need through the `Engine` protocol (`core.engine`), never
`isinstance(..., ReplicaEngine)`; a train step says it failed or was skipped in its `StepOutcome`
(`core.train.outcome`, the one module that names those metrics), never by a metric name someone matches.
The run's callbacks reach the server, its client table and its engines when they are built, never set
on them afterwards. Each bar is also run on a planted case of the old pattern, so it cannot pass by
finding nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layering import ROOT, _plant, graph

SERVER_SIDE = ("core.serve", "core.episodes", "core.sandbox")
CLIENT_PACKAGE = "core.clients"
ASKS_ENGINES = ("core/run", "core/serve")  # the packages that drive engines: the loop, the rollout metrics, the server
ENGINE_CLASS = "ReplicaEngine"
STEP_FLAGS = ("train/failed", "train/skipped")  # the metric names of a step that learnt nothing
NAMES_STEP_FLAGS = "core/train/outcome.py"  # the one module that gives them (StepOutcome.logged)


def _modules(root: Path, folders: tuple[str, ...] = ("core",)) -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(root).as_posix(), ast.parse(p.read_text()))
            for folder in folders for p in sorted((root / folder).rglob("*.py"))]


def _named(node: ast.AST, name: str) -> bool:
    """Whether `node` (a class, a dotted name or a tuple of them) names `name`."""
    return any(isinstance(n, ast.Name) and n.id == name or isinstance(n, ast.Attribute) and n.attr == name
               for n in ast.walk(node))


def engine_type_checks(root: Path) -> list[str]:
    """`isinstance`/`issubclass` against `ReplicaEngine` in the packages that drive engines: `path:line`."""
    return [f"{path}:{node.lineno}" for path, tree in _modules(root, ASKS_ENGINES) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2 and _named(node.args[1], ENGINE_CLASS)]


CALLBACKS = {"on_checkpoint", "on_shutdown", "on_swap", "on_lost", "is_open"}  # what the run hands the server side


def late_callbacks(root: Path) -> list[str]:
    """Callbacks set on an object after it was built: `x.on_lost = ...` on another object, or on `self`
    outside `__init__`. `path:line`."""
    found = []
    for path, tree in _modules(root):
        inits = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__init__"
                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in (e for target in targets for e in ast.walk(target)):
                if isinstance(t, ast.Attribute) and t.attr in CALLBACKS and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self" and id(node) in inits):
                    found.append(f"{path}:{node.lineno}")
    return found


def _docstrings(tree: ast.Module) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def step_flag_names(root: Path) -> list[str]:
    """Strings in the code (not docstrings) holding a step-failure metric name, outside the module that
    names them: a name compared, matched as a suffix or kept in a tuple to look for. `path:line`."""
    found = []
    for path, tree in _modules(root):
        if path == NAMES_STEP_FLAGS:
            continue
        docs = _docstrings(tree)
        found += [f"{path}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                  and any(flag in node.value for flag in STEP_FLAGS)]
    return found


def test_the_server_side_imports_nothing_from_the_client_package() -> None:
    edges = graph(ROOT)
    bad = [f"{mod} -> {target}" for mod, targets in edges.items() if mod.startswith(SERVER_SIDE)
           for target, _ in targets if target.startswith(CLIENT_PACKAGE)]
    assert not bad, "the server side imports the client package:\n" + "\n".join(bad)


def test_containment_is_not_in_the_client_package() -> None:
    clients = {p.stem for p in (ROOT / "core" / "clients").glob("*.py")}
    assert not clients & {"contain", "contained", "forwarder", "relay", "process_count", "venvs"}
    assert {"contained", "forwarder", "relay", "process_count", "venvs"} <= {p.stem for p in (ROOT / "core" / "contain").glob("*.py")}


def test_server_state_and_operator_commands_left_the_client_package() -> None:
    clients = {p.stem for p in (ROOT / "core" / "clients").glob("*.py")}
    assert not clients & {"table", "dealer", "judge", "hotswap", "server_files"}, clients
    assert (ROOT / "core" / "run" / "hotswap.py").is_file() and (ROOT / "core" / "run" / "server_files.py").is_file()


def test_a_planted_server_to_client_import_is_caught(tmp_path: Path) -> None:
    edges = _plant(tmp_path, {"core/serve/__init__.py": "", "core/serve/x.py": "from core.clients import sdk\n",
                              "core/clients/__init__.py": "", "core/clients/sdk.py": ""})
    assert [t for t, _ in edges["core.serve.x"]] == ["core.clients.sdk"]


def test_the_run_and_the_server_never_ask_whether_an_engine_is_a_replica_set() -> None:
    assert engine_type_checks(ROOT) == [], "ask the Engine protocol (core.engine) instead"


def test_a_planted_replica_engine_type_check_is_caught(tmp_path: Path) -> None:
    (tmp_path / "core" / "run").mkdir(parents=True)
    (tmp_path / "core" / "serve").mkdir(parents=True)
    (tmp_path / "core" / "run" / "loop.py").write_text(
        "from core.engine.replicas import ReplicaEngine\n"
        "def f(p):\n    if isinstance(p.engine, ReplicaEngine):\n        p.engine.sleep()\n")
    (tmp_path / "core" / "serve" / "server.py").write_text(
        "from core.engine import replicas\nok = isinstance(1, int)\nbad = isinstance(1, (int, replicas.ReplicaEngine))\n")
    assert engine_type_checks(tmp_path) == ["core/run/loop.py:3", "core/serve/server.py:3"]


def test_no_metric_name_signals_a_failed_step() -> None:
    assert (ROOT / NAMES_STEP_FLAGS).is_file()
    assert step_flag_names(ROOT) == [], "read StepOutcome.failed/skipped (core.train.outcome) instead"


def test_a_planted_failure_metric_match_is_caught_and_a_docstring_is_not(tmp_path: Path) -> None:
    (tmp_path / "core" / "run").mkdir(parents=True)
    (tmp_path / "core" / "run" / "loop.py").write_text(
        '"""A failed step logs `train/failed`."""\n'
        'FAILED_STEP = ("train/failed", "train/skipped")\n'
        "def failed(metrics):\n"
        '    """Whether `train/skipped` or `train/failed` is set."""\n'
        '    return metrics.get("train/failed", 0) > 0 or any(k.endswith("/train/skipped") for k in metrics)\n')
    (tmp_path / "core" / "train").mkdir(parents=True)
    (tmp_path / NAMES_STEP_FLAGS).write_text('NAMES = {"failed": "train/failed"}\n')  # the one place that names them
    assert step_flag_names(tmp_path) == ["core/run/loop.py:2", "core/run/loop.py:2", "core/run/loop.py:5",
                                         "core/run/loop.py:5"]


def test_callbacks_are_given_at_construction_never_set_afterwards() -> None:
    assert late_callbacks(ROOT) == [], "pass the callback to the constructor"


def test_a_planted_late_callback_is_caught(tmp_path: Path) -> None:
    (tmp_path / "core" / "run").mkdir(parents=True)
    (tmp_path / "core" / "run" / "loop.py").write_text(
        "class Run:\n"
        "    def __init__(self, server, on_lost):\n"
        "        self.on_lost = on_lost\n"  # its own callback, given to it: fine
        "        server.on_checkpoint = self.checkpoint\n"
        "        server.clients.on_swap, x = self.swapped, 1\n"
        "    def start(self, engine):\n"
        "        self.on_lost = None\n"
        "        engine.is_open: object = None\n")
    assert late_callbacks(tmp_path) == ["core/run/loop.py:4", "core/run/loop.py:5", "core/run/loop.py:7",
                                        "core/run/loop.py:8"]
