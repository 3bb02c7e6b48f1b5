"""Which arm a proposal is judged against: the reference that differs from it in one thing only.

- A config proposal changes the config: its reference is the base config at the base code.
- A code proposal (or any arm that runs a commit) changes the code: its reference is the base code
  run with the proposal's own config overrides, so that only the code differs. A patch proposed
  together with `trainer.lr=0.03` is compared with the base code at lr 0.03, not at the base lr.
- A chained code proposal (`parent: A`) is also judged against its parent: A's code with the
  proposal's overrides (A itself when it ran that config, length and seeds).
Both references run the same steps on the same seeds. A reference arm is never judged itself.
A replication stage (`extends`) adds seeds to the arm it extends; its scores pool with that arm's.

Pure functions over proposals: this module launches nothing and computes no verdict.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from researcher.records import Proposal

# The planner name of the arms the study's baseline rule adds (researcher.evidence.baselines).
BASELINE_PLANNER = "baseline"


def config_of(p: Proposal) -> dict[str, object]:
    """What a proposal changes besides its training length."""
    return {k: v for k, v in p.overrides.items() if k != "trainer.steps"}


def changed(p: Proposal, base_values: dict[str, Any]) -> dict[str, object]:
    """The overrides that differ from the base config (besides the training length)."""
    return {k: v for k, v in config_of(p).items() if base_values.get(k) != v}


def steps_of(p: Proposal, default_steps: int) -> int:
    return p.steps(default_steps)


def runs_code(p: Proposal) -> bool:
    """Whether the arm runs code other than the base: its own edits, a commit, or a parent's code."""
    return p.kind == "code" or p.commit is not None or (p.reference and p.parent is not None)


def is_baseline(p: Proposal, base_values: dict[str, object]) -> bool:
    """A proposal whose every override is the base config's own value, at the base commit (code never is)."""
    return (p.kind == "config" and not p.needs_code_change and p.commit is None and not runs_code(p)
            and all(base_values.get(k) == v for k, v in config_of(p).items()))


def is_reference(p: Proposal, base_values: dict[str, object]) -> bool:
    """An arm others are judged against (the base config, a rule or confirmation baseline, a parent's
    reference): it carries no verdict of its own."""
    return p.reference or p.planner == BASELINE_PLANNER or is_baseline(p, base_values)


def reference_config(p: Proposal, base_values: dict[str, Any]) -> dict[str, object]:
    """The config the reference of `p` runs: its own overrides when it changes code, else the base's."""
    return changed(p, base_values) if runs_code(p) else {}


def key(config: dict[str, object]) -> str:
    """A config as a hashable, order-free key (values may be lists or mappings)."""
    return json.dumps(sorted(config.items()), default=str)


def _same_runs(q: Proposal, p: Proposal, default_steps: int) -> bool:
    return q.seeds == p.seeds and steps_of(q, default_steps) == steps_of(p, default_steps)


def at_base_code(q: Proposal) -> bool:
    """An arm that runs the base code (with whatever config it carries): it can be a code proposal's reference."""
    return q.kind == "config" and not q.needs_code_change and not runs_code(q)


def baseline_for(p: Proposal, proposals: Sequence[Proposal], base_values: dict[str, object],
                 default_steps: int) -> Proposal | None:
    """The arm at the base code for `p`: same steps, seeds and reference config; the latest such.

    Any base-code arm of that config serves (a config proposal of lr 0.03 is the reference of a patch
    proposed with lr 0.03); a replication stage's own reference is found the same way (same seeds).
    """
    want = key(reference_config(p, base_values))
    same = [q for q in proposals if q.id != p.id and at_base_code(q) and _same_runs(q, p, default_steps)
            and key(changed(q, base_values)) == want]
    return same[-1] if same else None


def parent_reference_for(p: Proposal, proposals: Sequence[Proposal], base_values: dict[str, object],
                         default_steps: int) -> Proposal | None:
    """The arm running `p`'s parent's code with `p`'s config, steps and seeds: the parent itself when it
    ran them, else the latest reference arm the baseline rule added for it; None without a parent."""
    if p.parent is None or not runs_code(p):
        return None
    want = key(changed(p, base_values))
    parent = next((q for q in proposals if q.id == p.parent), None)
    if parent is not None and _same_runs(parent, p, default_steps) and key(changed(parent, base_values)) == want:
        return parent
    same = [q for q in proposals if q.reference and q.parent == p.parent and _same_runs(q, p, default_steps)
            and key(changed(q, base_values)) == want]
    return same[-1] if same else None


def line(first: Proposal, proposals: Iterable[Proposal]) -> list[Proposal]:
    """An arm and the replication stages that extend it, in stage order."""
    return sorted([q for q in proposals if q.id == first.id or q.extends == first.id], key=lambda q: q.stage)


def root(p: Proposal, proposals: Sequence[Proposal]) -> Proposal:
    """The first arm of the line `p` belongs to (itself unless it is a replication stage)."""
    return next((q for q in proposals if q.id == p.extends), p) if p.extends else p
