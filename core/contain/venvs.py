"""Sandbox venvs: the Python an isolated client runs, with the sandbox's own dependencies installed.

A sandbox may list `requirements = [...]` in its `sandbox.toml`. Those go into a venv of its own,
made with uv and cached under `<cache>/venvs/<hash>`, keyed by the requirements, the Python version
and the project's environment, so a second start (or another sandbox with the same list) reuses it
and nothing is rebuilt. The venv layers on top of the project's environment instead of copying it:
a `.pth` file adds the project's site-packages *after* the venv's own, so the client still imports
`core` (and never reinstalls torch), while a sandbox dependency that clashes with one of ours wins
inside that client. A sandbox without requirements runs on the project's own interpreter.

Deliberately not here: starting or supervising the client process (`core.run.loop`, `core.run.supervisor`),
and resource limits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from core.sandbox.folder import sandbox_meta, sandbox_requirements

log = logging.getLogger(__name__)

VENV_BUILD_TIMEOUT_S = 600.0  # one uv install; a cold PyPI download of a small package takes seconds
LAYER_PTH = "zz_swarmrl_project.pth"  # `zz`: processed after the venv's own .pth files


class VenvError(RuntimeError):
    """A sandbox venv that could not be built; the message names the sandbox and uv's error."""


def venvs_root() -> Path:
    """Where sandbox venvs are cached: `$SWARMRL_CACHE/venvs` (the model cache's home)."""
    return Path(os.environ.get("SWARMRL_CACHE", Path.home() / ".cache" / "swarmrl")) / "venvs"


def venv_key(requirements: list[str]) -> str:
    """The cache key: the sorted requirements, this Python and the project environment they layer on."""
    ident = {"requirements": sorted(r.strip() for r in requirements), "python": sys.version,
             "base": sysconfig.get_paths()["purelib"]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def client_python(spec: str) -> str:
    """The interpreter for an isolated client of `spec` (a sandbox folder): its cached venv's python when
    its `sandbox.toml` lists requirements, else this interpreter. Builds the venv on first use."""
    folder = Path(spec)
    if not (folder / "agent.py").is_file():  # a module spec: it runs where the project runs
        return sys.executable
    requirements = sandbox_requirements(folder, sandbox_meta(folder))
    if not requirements:
        return sys.executable
    return str(ensure_venv(requirements, label=str(folder)) / "bin" / "python")


def ensure_venv(requirements: list[str], label: str = "", root: Path | None = None) -> Path:
    """The venv holding `requirements` on top of the project's environment, built once and reused."""
    root = root or venvs_root()
    target = root / venv_key(requirements)
    if (target / "ready").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.info("building the venv of %s (%s) in %s", label or "a sandbox", ", ".join(requirements), target)
    build = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
    uv = _uv()
    try:
        _call([uv, "venv", "-q", "--python", sys.executable, str(build)], label)
        python = build / "bin" / "python"
        _call([uv, "pip", "install", "-q", "--python", str(python), *requirements], label)
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        # addsitedir (not a bare path line) so the project's own .pth files run too: the editable
        # install of `core` is one of them.
        (site / LAYER_PTH).write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        (build / "ready").write_text("\n".join(requirements) + "\n")
        try:
            build.rename(target)  # atomic: a concurrent builder of the same key either wins or finds it ready
        except OSError:
            if not (target / "ready").is_file():
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return target


def _uv() -> str:
    """uv from the project's environment (the Makefile installs it there), else from PATH."""
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.is_file() else shutil.which("uv")
    if found is None:
        raise VenvError("sandbox requirements need uv (`pip install uv`), found neither next to "
                        f"{sys.executable} nor on PATH")
    return found


def _call(cmd: list[str], label: str) -> None:
    what = " ".join([Path(cmd[0]).name, *cmd[1:3]])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=VENV_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise VenvError(f"venv of {label}: `{what} ...` took over {VENV_BUILD_TIMEOUT_S:.0f} s") from None
    if out.returncode != 0:  # uv's last lines, on one line: what it could not resolve or install
        tail = [line.strip() for line in (out.stderr or out.stdout).strip().splitlines()[-4:] if line.strip()]
        raise VenvError(f"venv of {label}: `{what} ...` failed: {' '.join(tail)}")
