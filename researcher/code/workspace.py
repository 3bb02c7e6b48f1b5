"""A study's code workspace: a git repository of its own holding copies of the editable paths.

`studies/<name>/workspace/` starts as one commit (the base) with copies of the brief's
`code.editable` paths from the project (a file-level entry also brings the rest of its sandbox
folder, which stays read-only). Every code proposal becomes a commit on top of its parent
proposal's commit, kept alive by a ref `refs/proposals/<id>`, so the study holds a lineage tree of
code versions. Edits are applied in a throw-away worktree of that repository (`trial`), checked
against the path rules, and committed only when validation passed; a run checks its commit out
into a folder of its own (`checkout`). Commits carry a fixed author and date, so a proposal
re-validated after a crash gets the very same commit id.

Path rules: an edit may only touch editable, non-readonly files inside the workspace, and never a
judged sandbox's judge: its sandbox.toml, the judge file and what it imports (`researcher.brief.judges`). Absolute
paths, `..`, symlinks pointing out of the workspace, new files outside `editable`, files git ignores
(a `.gitignore` would hide them from the diff and the commit) and deleting a sandbox's entry file are refused with a `WorkspaceError` naming the path. Every edit resolves the
real path it is about to write (following any symlink on the way) and refuses one outside the
trial worktree, or one the rules would refuse under its real name. The base copy refuses a project
whose editable paths hold a symlink resolving outside them (`data -> ../outside/`): copied as a
link, it would let an edit write through it. Nothing outside the workspace (and the folders it is
asked to write) ever changes: not the project, not another study.

Every git command runs through `researcher.code.study_git`: a worktree's git dir is the one this repository
records for it, never the worktree's own `.git` (contained code may have replaced it), and nothing a
repository's config names (fsmonitor, hooks, external diff) runs; `tampered` says when that `.git` changed.
It does not validate behaviour (researcher/code/validation.py does) and knows nothing of MLflow.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import tomllib
from pathlib import Path, PurePosixPath

from researcher.brief.judges import judge_paths, protected_by_judge, sandboxes_under
from researcher.code import study_git
from researcher.code.study_git import DIFF_SAFE, GitError, dotgit_problem, worktree_admin
from researcher.brief.schema import CodeSpec
from researcher.records import Edit

# Copies leave out what a sandbox folder may hold that is not code.
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".venv")
BASE_REF = "refs/heads/base"


class WorkspaceError(ValueError):
    """An edit or patch the workspace refuses; the message names the path and the reason."""


class EditError(WorkspaceError):
    """A search/replace block that does not match exactly once; carries the file's current text."""

    def __init__(self, message: str, file: str, current: str) -> None:
        super().__init__(message)
        self.file, self.current = file, current


def _git(repo: Path, *args: str, input_text: str | None = None, check: bool = True) -> str:
    """git on the repository whose main worktree is `repo` (`researcher.code.study_git`)."""
    try:
        return study_git.run(repo / ".git", repo, *args, input_text=input_text, check=check)
    except GitError as e:
        raise WorkspaceError(str(e)) from None


def sandbox_folders(editable: list[str], project: Path) -> list[str]:
    """The sandbox folders (`sandboxes/<name>`) of file-level editable entries that no entry covers whole."""
    out: list[str] = []
    for rel in editable:
        parts = PurePosixPath(rel).parts
        if len(parts) >= 3 and parts[0] == "sandboxes" and (project / rel).is_file():
            folder = "/".join(parts[:2])
            if not _inside(folder, editable) and folder not in out:
                out.append(folder)
    return out


def _inside(rel: str, roots: list[str]) -> bool:
    return any(rel == r or rel.startswith(r + "/") for r in roots)


class Workspace:
    def __init__(self, root: Path, spec: CodeSpec, project: Path) -> None:
        self.root, self.spec, self.project = root, spec, project
        self._judges: dict[str, list[str]] | None = None  # read once from the base (`judges`)

    # -- the repository ---------------------------------------------------------------------
    def base(self) -> str:
        """The base commit, creating the repository on first use (copies of the editable paths)."""
        if (self.root / ".git").is_dir():
            head = _git(self.root, "rev-parse", "--verify", "--quiet", BASE_REF, check=False).strip()
            if head:
                return head
        # Built next to its final place and renamed: a crash leaves no half-made workspace behind.
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self._refuse_escaping_links()
        tmp = Path(tempfile.mkdtemp(prefix=".workspace-", dir=self.root.parent))
        # A file-level entry brings its sandbox folder's other files too (read-only: not editable), or
        # the runs' checkouts would hold a sandbox of one file.
        for rel in [*self.spec.editable, *sandbox_folders(self.spec.editable, self.project)]:
            src, dst = self.project / rel, tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, ignore=_IGNORED, symlinks=True, dirs_exist_ok=True)
            elif not dst.exists():
                shutil.copy2(src, dst)
        _git(tmp, "init", "-q", "-b", "base")  # GIT_DIR given: git makes it here
        _git(tmp, "add", "-A")
        _git(tmp, "commit", "-q", "-m", "base: the project's editable paths")
        if self.root.exists():
            shutil.rmtree(self.root)
        tmp.rename(self.root)
        return _git(self.root, "rev-parse", BASE_REF).strip()

    def _refuse_escaping_links(self) -> None:
        """Refuse a symlink under the editable paths that resolves outside all of them (named, with its target)."""
        roots = [(self.project / rel).resolve() for rel in self.spec.editable]
        for rel in self.spec.editable:
            top = self.project / rel
            if not top.is_dir():
                continue
            for folder, dirs, files in os.walk(top):
                for name in dirs + files:
                    path = Path(folder) / name
                    if not path.is_symlink():
                        continue
                    target = path.resolve()
                    if not any(target == r or target.is_relative_to(r) for r in roots):
                        raise WorkspaceError(
                            f"{path.relative_to(self.project)}: a symlink to {os.readlink(path)} (resolving to "
                            f"{target}) leads outside the editable paths {self.spec.editable}; edits could write "
                            "through it, so the workspace is not created. Replace the link by a copy, or make "
                            "its target editable.")

    def commit_of(self, proposal_id: str) -> str | None:
        out = _git(self.root, "rev-parse", "--verify", "--quiet", f"refs/proposals/{proposal_id}", check=False)
        return out.strip() or None

    def proposal_refs(self) -> dict[str, str]:
        out = _git(self.root, "for-each-ref", "--format=%(refname) %(objectname)", "refs/proposals/")
        return {line.split()[0].removeprefix("refs/proposals/"): line.split()[1] for line in out.splitlines() if line}

    def diff(self, parent: str, commit: str) -> str:
        return _git(self.root, "diff", "--no-color", "--no-renames", *DIFF_SAFE, parent, commit)

    def files(self, commit: str) -> dict[str, str]:
        """Text of every file at `commit` (what the llm planner sees of the code)."""
        names = _git(self.root, "ls-tree", "-r", "--name-only", commit).splitlines()
        return {n: _git(self.root, "show", f"{commit}:{n}") for n in names if n.endswith((".py", ".toml", ".md"))}

    # -- folders at a commit ----------------------------------------------------------------
    def checkout(self, commit: str, folder: Path) -> Path:
        """Write the code at `commit` to `folder` (a detached worktree); reuses one already there, when its
        `.git` is still the link git wrote (contained code may have written the folder)."""
        admin = worktree_admin(self.root, folder) if folder.exists() else None
        if admin is not None and dotgit_problem(folder, admin) is None:
            if self.tree_git(folder, "rev-parse", "HEAD", check=False).strip() == commit:
                return folder
        self.remove(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        _git(self.root, "worktree", "add", "-q", "--detach", str(folder), commit)
        return folder

    def remove(self, folder: Path) -> None:
        """Drop a worktree (and whatever a killed process left of one): the folder is deleted without git
        looking into it (a `git worktree remove` would read its `.git`), then git forgets it (`prune`)."""
        if folder.exists() or folder.is_symlink():
            if folder.is_symlink():
                folder.unlink()
            else:
                shutil.rmtree(folder, ignore_errors=True)
        _git(self.root, "worktree", "prune")

    def tree_git(self, tree: Path, *args: str, input_text: str | None = None, check: bool = True) -> str:
        """git on the worktree `tree` of this workspace, through the git dir the repository keeps for it, never
        through `tree/.git`; refused (WorkspaceError) when that `.git` changed (`tampered`)."""
        admin = worktree_admin(self.root, tree)
        if admin is None:
            raise WorkspaceError(f"{tree} is no worktree of the study's workspace {self.root}")
        problem = dotgit_problem(tree, admin)
        if problem is not None:
            raise WorkspaceError(f"the trial tree's .git was changed: {problem}; the study runs no git in it")
        try:
            return study_git.run(admin, tree, *args, input_text=input_text, check=check)
        except GitError as e:
            raise WorkspaceError(str(e)) from None

    def tampered(self, tree: Path) -> str | None:
        """Why `tree`'s `.git` is no longer the link to this workspace that git wrote (contained code changed
        it), or None when it is."""
        admin = worktree_admin(self.root, tree)
        if admin is None:
            return f"the trial tree's .git: {tree} is no longer a worktree of the study's workspace"
        problem = dotgit_problem(tree, admin)
        return None if problem is None else f"the trial tree's .git was changed by the proposal's code: {problem}"

    def staged_diff(self, tree: Path) -> str:
        """The diff of what is staged in a trial tree (what the reviewer reads and the commit holds)."""
        return self.tree_git(tree, "diff", "--cached", "--no-color", "--no-renames", *DIFF_SAFE)

    def changed(self, tree: Path, against: list[str]) -> list[str]:
        """The files added or modified in a trial tree, against `against` (`--cached`, or two commits)."""
        out = self.tree_git(tree, "diff", *against, "--name-only", "--no-renames", "--diff-filter=AM", *DIFF_SAFE)
        return [line for line in out.splitlines() if line]

    # -- path rules -------------------------------------------------------------------------
    def check_path(self, rel: str, action: str) -> str:
        """Refuse a path an edit may not touch; `action` is add, modify or delete. -> the clean path."""
        if rel.startswith("/") or PurePosixPath(rel).is_absolute():
            raise WorkspaceError(f"{rel}: absolute paths are refused; give paths relative to the workspace root")
        if ".." in PurePosixPath(rel).parts:
            raise WorkspaceError(f"{rel}: paths containing '..' are refused")
        clean = str(PurePosixPath(rel))
        if not _inside(clean, self.spec.editable):
            what = "new files" if action == "add" else "files"
            raise WorkspaceError(f"{clean}: {what} outside the editable paths {self.spec.editable} are refused")
        if _inside(clean, self.spec.readonly):
            raise WorkspaceError(f"{clean}: read-only by the brief (code.readonly); it may not change")
        judged = protected_by_judge(clean, self.judges())
        if judged is not None:
            raise WorkspaceError(f"{clean}: part of the judge of {judged} (its sandbox.toml, its judge file, a file "
                                 "the judge imports or reads, or a file Python could import under a name it imports: "
                                 "any import suffix (.so, .pyc, ...), a package folder, __pycache__/, .pth); the study decides "
                                 "only on that judge's scores, so no proposal may change it (DESIGN §3.7)")
        if action == "delete" and clean in self.entry_files():
            raise WorkspaceError(f"{clean}: deleting a sandbox's entry file is refused")
        return clean

    def judges(self) -> dict[str, list[str]]:
        """Judged sandbox folder (workspace-relative) -> the paths its judge is made of, read from the base:
        what the runs' servers load, and what every proposal leaves as it is (`researcher.brief.judges`)."""
        if self._judges is None:
            self._judges = {str(f.relative_to(self.root)): paths for f in sandboxes_under(self.root)
                            if (paths := judge_paths(f))} if self.root.is_dir() else {}
        return self._judges

    def entry_files(self) -> set[str]:
        """`<sandbox>/<entry>` of every sandbox folder in the workspace's base."""
        out = set()
        for toml in self.root.rglob("sandbox.toml"):
            if ".git" in toml.parts:
                continue
            try:
                entry = tomllib.loads(toml.read_text()).get("entry", "agent.py")
            except tomllib.TOMLDecodeError:
                entry = "agent.py"
            out.add(str((toml.parent / entry).relative_to(self.root)))
        return out

    def check_changes(self, tree: Path) -> list[tuple[str, str]]:
        """Stage everything in a trial tree and refuse what the rules forbid. -> [(status, path)]."""
        self.tree_git(tree, "add", "-A")
        # A file the edit wrote that git ignores (a `.gitignore` it adds, even one listing itself) stays out of
        # the diff, the review and the commit, yet sits in the trial tree the executing steps run in: refused.
        hidden = [rel for rel in self.tree_git(tree, "ls-files", "-z", "--others", "--ignored", "--exclude-standard").split("\0")
                  if rel]
        if hidden:
            where = ", ".join(f"{rel} ({'editable' if _inside(rel, self.spec.editable) else 'outside the editable paths'})"
                              for rel in hidden[:5])
            raise WorkspaceError(f"the change writes {len(hidden)} file(s) git ignores: {where}; ignored files would "
                                 "stay out of the diff a reviewer reads and of the commit, so they are refused "
                                 "(remove them or the .gitignore pattern that hides them)")
        out = self.tree_git(tree, "diff", "--cached", "--name-status", "--no-renames", *DIFF_SAFE)
        changes = [(line.split("\t", 1)[0], line.split("\t", 1)[1]) for line in out.splitlines() if line]
        if not changes:
            raise WorkspaceError("the edit changes nothing")
        root = tree.resolve()
        for status, rel in changes:
            action = {"A": "add", "D": "delete"}.get(status[0], "modify")
            self.check_path(rel, action)
            path = tree / rel
            if path.is_symlink():
                target = (path.parent / os.readlink(path)).resolve()
                if target != root and root not in target.parents:
                    raise WorkspaceError(f"{rel}: a symlink pointing outside the workspace ({os.readlink(path)}) "
                                         "is refused")
        return changes

    # -- trials -----------------------------------------------------------------------------
    def apply_edits(self, tree: Path, edits: list[Edit]) -> None:
        """Apply search/replace blocks in a trial tree; each must match exactly once."""
        for edit in edits:
            exists = (tree / edit.file).is_file() if not edit.file.startswith("/") else False
            rel = self.check_path(edit.file, "modify" if exists or edit.search else "add")
            path = self._real(tree, rel, "modify" if exists or edit.search else "add")
            if not edit.search:
                if path.exists():
                    raise EditError(f"{rel}: an empty search block creates a file, but the file exists",
                                    rel, path.read_text(errors="replace"))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(edit.replace)
                continue
            if not path.is_file():
                raise EditError(f"{rel}: no such file in the workspace", rel, "")
            text = path.read_text()
            count = text.count(edit.search)
            if count != 1:
                how = "does not match" if count == 0 else f"matches {count} times"
                raise EditError(f"{rel}: the search block {how}; it must match the file's text exactly once",
                                rel, text)
            path.write_text(text.replace(edit.search, edit.replace, 1))

    def _real(self, tree: Path, rel: str, action: str) -> Path:
        """The real path an edit of `rel` writes, symlinks followed: inside the worktree and allowed under
        its real name too, else a `WorkspaceError` naming both."""
        root, real = tree.resolve(), (tree / rel).resolve()
        if not real.is_relative_to(root) or real == root:
            raise WorkspaceError(f"{rel}: resolves to {real}, outside the workspace (through a symlink); "
                                 "writing there is refused")
        real_rel = real.relative_to(root).as_posix()
        if real_rel != rel:
            try:
                self.check_path(real_rel, action)
            except WorkspaceError as e:
                raise WorkspaceError(f"{rel}: resolves through a symlink to {real_rel}, which is refused: {e}") from None
        return real

    def apply_patch(self, tree: Path, patch: str) -> None:
        """Apply a person's unified diff (paths relative to the workspace root, a/ b/ prefixes)."""
        for rel in patch_paths(patch):
            if rel.startswith("/") or ".." in PurePosixPath(rel).parts:
                self.check_path(rel, "modify")  # raises with the path and the reason
        try:
            self.tree_git(tree, "apply", "--whitespace=nowarn", "-", input_text=patch)
        except WorkspaceError as e:
            raise WorkspaceError(f"the patch does not apply: {str(e).split(' failed: ', 1)[-1]}") from None

    def commit_trial(self, tree: Path, proposal_id: str, message: str) -> str:
        """Commit the staged trial and pin it with refs/proposals/<id>. -> the commit id."""
        self.tree_git(tree, "commit", "-q", "--no-verify", "-m", message)
        commit = self.tree_git(tree, "rev-parse", "HEAD").strip()
        _git(self.root, "update-ref", f"refs/proposals/{proposal_id}", commit)
        return commit


    def drop_proposal(self, proposal_id: str) -> None:
        """Forget a proposal's commit (it failed a step after it was committed): nothing runs or builds on it."""
        _git(self.root, "update-ref", "-d", f"refs/proposals/{proposal_id}", check=False)


def patch_paths(patch: str) -> list[str]:
    """Every path a unified diff names, without its a/ or b/ prefix."""
    out = []
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            out += [p.split("/", 1)[1] if p[:2] in ("a/", "b/") else p for p in line.split()[2:4]]
        elif line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t")[0].strip()
            if path != "/dev/null":
                out.append(path[2:] if path[:2] in ("a/", "b/") else path)
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            out.append(line.split(" ", 2)[2])
    return list(dict.fromkeys(out))
