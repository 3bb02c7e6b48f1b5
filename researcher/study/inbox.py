"""People's proposals: `researcher study propose` drops them here; the study's plan node takes them up.

Each proposal is one JSON file `.study/inbox/p<N>.json`. Its id is claimed by creating the file
exclusively (`O_EXCL`), so two people proposing at once get distinct ids, and a study that is
running, waiting or stopped takes the proposal up at its next plan. This module stores and lists;
it does not validate code or decide anything, beyond refusing a hot swap with no patch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from researcher.records import HOT_SWAP_NEEDS_CODE, now_iso

# Ids of people's proposals: p1, p2, ... (the planner's are r<round>-<i>, so they never collide).
PREFIX = "p"


class PersonProposal(BaseModel):
    """What a person proposed, as `researcher study propose` received it."""

    id: str
    hypothesis: str = Field(min_length=3)
    overrides: dict[str, Any] = Field(default_factory=dict)  # --set key=value, values parsed as YAML
    patch: str | None = None  # unified diff against the workspace, paths a/<path> b/<path>
    parent: str | None = None  # the code proposal whose version the patch applies on; None: the base
    hot_swap: bool = False  # --hot-swap: swap the code into the study's live run instead of new runs
    by: str
    at: str = Field(default_factory=now_iso)

    @model_validator(mode="after")
    def _hot_swap_is_code(self):
        if self.hot_swap and not self.patch:
            raise ValueError(HOT_SWAP_NEEDS_CODE)
        return self


def add(folder: Path, proposal: dict[str, Any]) -> PersonProposal:
    """Store a proposal under the next free id. -> the stored proposal."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(list(folder.glob(f"{PREFIX}*.json"))) + 1
    while True:
        pid = f"{PREFIX}{n}"
        item = PersonProposal.model_validate({**proposal, "id": pid})
        try:
            fd = os.open(folder / f"{pid}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            n += 1
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(item.model_dump_json(indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        return item


def pending(folder: Path, known: set[str]) -> list[PersonProposal]:
    """Stored proposals the study has not taken up yet, in id order."""
    out = []
    for path in folder.glob(f"{PREFIX}*.json"):
        if path.stem in known:
            continue
        try:
            out.append(PersonProposal.model_validate_json(path.read_text()))
        except ValueError:
            continue  # still being written by `propose`: taken up at the next look
    return sorted(out, key=lambda x: int(x.id.removeprefix(PREFIX)))
