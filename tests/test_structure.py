"""One package per process: the server side imports nothing of the agent side, and containment is a package of its own.

The layering itself (which package may import which) is tests/test_layering.py; these are the bars of
the structure it cannot express as an order: the server (`serve/`, `episodes/`, `sandbox/`) and the
agent side (`clients/`) run in different processes, so neither reaches into the other's modules.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import ROOT, _plant, graph

SERVER_SIDE = ("core.serve", "core.episodes", "core.sandbox")
CLIENT_PACKAGE = "core.clients"


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
