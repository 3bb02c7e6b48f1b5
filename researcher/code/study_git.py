"""The study's own git: every git command it runs, on its workspace repository or on a worktree of it.

A trial worktree (and a run's checkout) is writable to contained code, and git follows a worktree's `.git`
to its repository and runs what that repository's config names: `core.fsmonitor`, hooks, filters,
`diff.external`, textconv. Code that replaced `.git` with a repository of its own would have the study's
uncontained `git diff` and `git commit` run its script on the host, with the study's secrets. So `run`:
- never discovers a repository: GIT_DIR and GIT_WORK_TREE are explicit, and a worktree's git dir is the
  one the workspace repository itself records for that folder (`worktree_admin`, read from
  `<repo>/.git/worktrees/*/gitdir`, which contained code cannot write), never the folder's `.git`;
- reads no config but that repository's: no system or global config, no attributes file, no inherited
  `GIT_*` variable (a parent's GIT_CONFIG_PARAMETERS or GIT_INDEX_FILE);
- turns off, on the command line, what runs a program: `core.fsmonitor`, `core.hooksPath` (/dev/null),
  and external diff and textconv for the diffs (`DIFF_SAFE`).
`dotgit_problem` says how a worktree's `.git` differs from the link git wrote (validation checks it after
each contained step and fails the step on a change). It runs git and reads files; it decides nothing.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

# Commits carry this identity and date so the same change on the same parent is the same commit.
IDENTITY = {"GIT_AUTHOR_NAME": "swarmrl researcher", "GIT_AUTHOR_EMAIL": "researcher@swarmrl.invalid",
            "GIT_COMMITTER_NAME": "swarmrl researcher", "GIT_COMMITTER_EMAIL": "researcher@swarmrl.invalid",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000"}
# No config but the repository's own, no attributes beyond the tree's (which can name a filter or diff driver,
# never define one: definitions live in config), no prompt, no optional lock a reader would take.
_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"}
# Settings that would run a program, off whatever a config says (command-line config wins over every file).
_OFF = ("-c", "core.fsmonitor=false", "-c", f"core.hooksPath={os.devnull}", "-c", f"core.attributesFile={os.devnull}",
        "-c", "protocol.allow=never")
DIFF_SAFE = ("--no-ext-diff", "--no-textconv")  # for every diff: no external diff program, no textconv filter


class GitError(ValueError):
    """A git command that failed; the message names the command and git's words."""


def run(git_dir: Path, work_tree: Path | None, *args: str, input_text: str | None = None, check: bool = True) -> str:
    """`git args` on the repository at `git_dir` (and `work_tree`), in that tree (or the git dir). -> stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(IDENTITY, **_ENV, GIT_DIR=str(git_dir))
    if work_tree is not None:
        env["GIT_WORK_TREE"] = str(work_tree)
    done = subprocess.run(["git", *_OFF, *args], cwd=work_tree or git_dir, input=input_text, capture_output=True,
                          text=True, env=env)
    if check and done.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def worktree_admin(repo: Path, folder: Path) -> Path | None:
    """The git dir the repository at `repo` (its main worktree) keeps for its linked worktree `folder`, found
    from the repository's side (module docstring); None when `folder` is no worktree of it."""
    link = folder.resolve() / ".git"  # the folder resolved (ours), its .git not (it may be anything now)
    admins = repo / ".git" / "worktrees"
    for admin in sorted(admins.iterdir()) if admins.is_dir() else []:
        try:
            if Path((admin / "gitdir").read_text().strip()) == link:
                return admin
        except OSError:
            continue
    return None


def dotgit_problem(folder: Path, admin: Path) -> str | None:
    """How `folder/.git` differs from the link to `admin` that git wrote, or None when it is that link."""
    dotgit = folder / ".git"
    try:
        info = dotgit.lstat()
    except FileNotFoundError:
        return "it was removed"
    if stat.S_ISLNK(info.st_mode):
        return f"it is now a symlink to {os.readlink(dotgit)}"
    if stat.S_ISDIR(info.st_mode):
        return "it is now a folder (a repository of its own), not the link to the study's repository"
    if not stat.S_ISREG(info.st_mode):
        return "it is no longer a plain file"
    text = dotgit.read_text(errors="replace").strip()
    if text != f"gitdir: {admin}" and Path(text.removeprefix("gitdir: ")) != admin.resolve():
        return f"it now points elsewhere ({text[:200]!r})"
    return None
