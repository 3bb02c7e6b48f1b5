"""A code proposal's lineage: which parent it may build on, its chain of ancestors, the whole change it brings.

A code proposal may name a `parent`, another code proposal whose version its edits apply on. Approving the
child runs the parent's code too, so a parent must be one a person (or the brief's policy) approved and
whose code then ran its validation steps and passed (`parent_problem`); otherwise a vetoed or never-reviewed
change would run through its child. The planner's check, `researcher study propose --parent`, the validate
node and approval (the review node, `researcher study approve`) all ask `parent_problem`, and a parent that
can never be built on (`parent_ended`: vetoed, or invalid) ends its pending children. What a reviewer reads
of a child is its whole chain (`chain_of`) and the cumulative diff against the base commit (`Lineage`).

Pure functions over the study's records (and `git diff` for the cumulative diff); it decides nothing about
whether code is good and writes nothing.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from researcher.records import CodeVersion, Decision, Proposal


def parent_problem(parent: str, proposals: list[Proposal], decisions: list[Decision],
                   code: list[CodeVersion]) -> str | None:
    """Why a code proposal may not build on `parent`, or None when it may: the parent must be a code
    proposal of the study that a person (or the brief's policy) approved and whose code then ran every
    validation step and passed. Anything less would run code nobody approved through its child."""
    found = [p for p in proposals if p.id == parent]
    if not found:
        return f"parent {parent} is not a proposal of this study"
    if found[0].kind != "code":
        return f"parent {parent} is a config proposal: only a code proposal's version can be built on"
    decision = next((d for d in reversed(decisions) if d.proposal_id == parent), None)
    version = next((v for v in reversed(code) if v.proposal_id == parent), None)
    if decision is not None and decision.verdict == "vetoed":
        return f"parent {parent} was vetoed by {decision.by}" + (f" ({decision.reason})" if decision.reason else "")
    if version is not None and not version.passed:
        return f"parent {parent} failed validation at step {version.failed_step}"
    if decision is None:
        return f"parent {parent} is not approved (it awaits review): build on it once it is approved and executed"
    if version is None or version.pending or not version.commit:
        return f"parent {parent} is approved but its code has not run its validation steps yet"
    return None


def parent_ended(parent: str, decisions: list[Decision], code: list[CodeVersion]) -> bool:
    """Whether `parent` can never be built on: vetoed, or its code failed a validation step."""
    return (any(d.proposal_id == parent and d.verdict == "vetoed" for d in decisions)
            or any(v.proposal_id == parent and not v.passed for v in code))


def chain_of(proposal_id: str, proposals: list[Proposal]) -> list[str]:
    """The ancestors of a proposal through `parent`, the oldest first (a cycle or an unknown id ends it)."""
    by_id = {p.id: p for p in proposals}
    chain: list[str] = []
    current = by_id.get(proposal_id)
    while current is not None and current.parent and current.parent not in chain and current.parent != proposal_id:
        chain.insert(0, current.parent)
        current = by_id.get(current.parent)
    return chain


@dataclass(frozen=True)
class Lineage:
    """What a reviewer reads of a proposal on a parent: its ancestors (the oldest first) and its whole change
    against the workspace's base commit, every ancestor's edits and its own."""

    chain: list[str] = field(default_factory=list)
    base_diff: str = ""

    def review_diff(self, proposal_id: str, own: str) -> str:
        """The text a reviewer reads: for a proposal on a parent the chain, the cumulative diff against the base
        commit (the code that runs once it is approved), then its own step; else its own diff."""
        if not self.chain:
            return own
        chain = " -> ".join(["base", *self.chain, proposal_id])
        return (f"# chain: {chain}; approving it approves all of this code\n"
                f"# the whole change against the base commit:\n{self.base_diff or '(not available)'}\n"
                f"# {proposal_id}'s own change on {self.chain[-1]}:\n{own}")


def lineage(proposal_id: str, proposals: list[Proposal], version: CodeVersion | None, workspace: Path,
            base: str) -> Lineage:
    """The lineage of a proposal: its chain, and, when it has a parent and a commit, its diff against `base`
    read from the study's `workspace` repository."""
    chain = chain_of(proposal_id, proposals)
    if not chain or version is None or not version.commit or not base:
        return Lineage(chain)
    done = subprocess.run(["git", "-C", str(workspace), "diff", "--no-color", "--no-renames", base, version.commit],
                          capture_output=True, text=True)
    return Lineage(chain, done.stdout if done.returncode == 0 else f"(the diff could not be read: {done.stderr.strip()})")
