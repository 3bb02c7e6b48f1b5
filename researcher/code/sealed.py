"""One sealed judge per study: the judges of the base commit, copied once into the study's state, by digest.

A study compares arms that run different code (the baseline at the base commit, a candidate, its parent,
a confirmation, a live A/B). If each run loaded its judge from the code it checks out, two arms of one
comparison could be scored by two judges, and a proposal could move the yardstick without touching a
file the path rules name (issue 38: a planted `__pycache__` pyc, a `.so` beside a module the judge
imports). So at study start every judged sandbox of the workspace's base (`Workspace.judges`: its
sandbox.toml, which also holds the episode protocol, its judge file and what the judge imports or reads,
followed with `ast` by `researcher.brief.judges`) is copied into `<state>/judges/<sandbox folder name>/`,
with the sha256 of every file in `sealed.json`. Every run of the study gets that folder as
`server.judges_dir` (`researcher.runs.launcher`), so its server loads the judge from there, from source with
bytecode off (`core.sandbox.judge`), never from the proposal's checkout.

`verify` re-reads the sealed folder before each launch: a file changed, missing or added (a `__pycache__`
planted there) refuses the launch rather than score an arm by a judge the study did not seal. Copies leave
out `__pycache__/` and bytecode, which are never part of a judge's source.

It copies and hashes files only; it does not load or run a judge, and does not decide which paths a
proposal may edit (`researcher.brief.judges`, `researcher.code.workspace`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel

from researcher.code.workspace import Workspace

MANIFEST = "sealed.json"
# Never copied: bytecode is rebuilt from source by whoever loads the judge (and the core loads it with
# bytecode off), so a cache here could only be something the source does not say.
_LEFT_OUT = ("__pycache__",)
_BYTECODE = (".pyc", ".pyo")


class SealError(RuntimeError):
    """The sealed judges are missing or not what the study sealed; the message names the file."""


class SealedJudge(BaseModel):
    sandbox: str  # the sandbox folder's name: the sub-folder of judges_dir the core loads it from
    source: str  # its folder in the workspace, e.g. sandboxes/letters
    files: dict[str, str]  # path relative to the sealed folder -> sha256 of its bytes


class SealedJudges(BaseModel):
    base: str  # the workspace commit the judges were copied from
    judges: list[SealedJudge]

    def digest(self) -> str:
        """One sha256 over every sealed file's path and digest: what a verdict names as its judge."""
        lines = sorted(f"{j.sandbox}/{path} {sha}" for j in self.judges for path, sha in j.files.items())
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(folder: Path) -> list[Path]:
    """Every file under `folder` as a path relative to it, links included (a link is never followed)."""
    out = []
    for here, dirs, names in os.walk(folder, followlinks=False):
        out += [Path(here, n).relative_to(folder) for n in names]
        out += [Path(here, d).relative_to(folder) for d in dirs if Path(here, d).is_symlink()]
    return sorted(out)


def seal(workspace: Workspace, dest: Path, base: str) -> SealedJudges:
    """Copy every judged sandbox's judge at the workspace's base into `dest` and record the digests; a study
    resumed after sealing gets the sealed copy back, verified, never a fresh one."""
    if (dest / MANIFEST).is_file():
        return verify(dest)
    judged = workspace.judges()
    names = [Path(folder).name for folder in judged]
    if len(set(names)) != len(names):
        raise SealError(f"two judged sandboxes share a folder name ({sorted(judged)}); the core finds a sealed judge "
                        "by its sandbox folder's name, so each must be unique")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final place and renamed: a crash leaves no half-sealed folder to be taken for a seal.
    tmp = Path(tempfile.mkdtemp(prefix=".judges-", dir=dest.parent))
    sealed = []
    for folder, paths in sorted(judged.items()):
        src, out = workspace.root / folder, tmp / Path(folder).name
        out.mkdir()
        for rel in paths:
            path = src / rel
            if path.is_symlink():
                raise SealError(f"{folder}/{rel}: part of a judge and a symlink; a judge is sealed from its own files")
            if path.is_dir():
                shutil.copytree(path, out / rel, ignore=shutil.ignore_patterns(*_LEFT_OUT, *(f"*{s}" for s in _BYTECODE)))
            elif path.is_file():
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, out / rel)
            # else: a name the judge imports that no file of the folder holds (a stdlib module): nothing to copy
        sealed.append(SealedJudge(sandbox=Path(folder).name, source=folder,
                                  files={str(p): _sha(out / p) for p in _files(out)}))
    record = SealedJudges(base=base, judges=sealed)
    (tmp / MANIFEST).write_text(record.model_dump_json(indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return record


def verify(dest: Path) -> SealedJudges:
    """The sealed record, once every file under `dest` is exactly what it names: else a `SealError`."""
    try:
        record = SealedJudges.model_validate_json((dest / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise SealError(f"{dest / MANIFEST}: the study's sealed judges cannot be read ({e})") from None
    expected = {Path(j.sandbox) / p: sha for j in record.judges for p, sha in j.files.items()}
    found = {p for p in _files(dest) if str(p) != MANIFEST}
    for extra in sorted(found - set(expected)):
        raise SealError(f"{dest / extra}: a file the study did not seal lies among its judges; no run is scored "
                        "by a judge it was not started with")
    for path, sha in sorted(expected.items()):
        full = dest / path
        if path not in found or full.is_symlink() or not full.is_file():
            raise SealError(f"{full}: a sealed judge file is missing")
        if _sha(full) != sha:
            raise SealError(f"{full}: changed since the study sealed it (sha256 {sha[:12]})")
    return record
