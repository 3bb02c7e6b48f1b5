"""What the llm planner is told about code, and how its search/replace edits are checked.

`describe_code` renders the editable files within the brief's `code.context_chars`, never cutting
one: a file that does not fit is left out whole and named, so the model never edits text it was
not shown. Then each valid earlier code proposal's files that differ from the base, at its commit
(what a proposal with that `parent` edits), in the same budget; the reply format of an edit; and
the earlier code proposals with their diffs, validation outcome and log tails, so the model learns
from what failed. `edit_problems` checks each proposed block against the whole text of the file
it applies to (the base's, or its parent's): exact, exactly once. A problem goes back to the model
with the file's text for a bounded number of repairs, after which the proposal goes on and fails
validation at `apply`. It reads; it changes no file.
"""

from __future__ import annotations

from researcher.planner.types import PlanContext
from researcher.records import ProposalDraft

# Diffs and logs of earlier code proposals are cut to this many characters each in the prompt.
_HISTORY_CHARS = 600

EDIT_FORMAT = ('"edits": [{"file": "sandboxes/NAME/agent.py", "search": "exact old text", '
               '"replace": "new text"}]')


def describe_code(ctx: PlanContext) -> str:
    """The prompt's code section ("" when the brief edits no code)."""
    spec = ctx.brief.code
    if spec is None:
        return ""
    left = [spec.context_chars]
    files = _fit("", ctx.code_files, left)
    for v in ctx.code:
        changed = {n: t for n, t in ctx.version_files.get(v.proposal_id, {}).items() if ctx.code_files.get(n) != t}
        if changed:
            files += f"\n\n# Files of {v.proposal_id} at {v.commit[:12]} (edit these when parent is {v.proposal_id})\n"
            files += _fit(f"{v.proposal_id}: ", changed, left)
    history = []
    for v in ctx.code:
        outcome = f"valid, commit {v.commit[:12]}" if v.passed else f"INVALID at {v.failed_step}"
        detail = v.diff[:_HISTORY_CHARS] if v.passed else v.log()[-_HISTORY_CHARS:]
        history.append(f"- {v.proposal_id}: {outcome}\n{detail}")
    return (f"# Code you may edit\nEditable: {spec.editable}; read-only: {spec.readonly}.\n"
            f"A code proposal adds {EDIT_FORMAT} to its object (and needs_code_change=true): each search text "
            "must occur exactly once in the file. Set \"parent\" to the id of an earlier code proposal that was "
            "approved and whose code ran (validated after approval) to build on its code; a parent still pending, "
            "vetoed or invalid is refused." + (" This study keeps a live run: add \"mode\": \"hot_swap\" to swap the change into it "
                          "(judged on the reward just before and after the swap) instead of new runs."
                          if ctx.brief.run.live else "") + "\n\n" + files + ("\n\n# Earlier code proposals\n" + "\n".join(history) if history else ""))


def _fit(label: str, files: dict[str, str], left: list[int]) -> str:
    """Whole files while `left[0]` characters last; the rest named as left out (never cut)."""
    shown, out = [], []
    for name, text in files.items():
        if len(text) <= left[0]:
            shown.append(f"## {label}{name}\n```\n{text}\n```")
            left[0] -= len(text)
        else:
            out.append(f"{name} ({len(text)} chars)")
    if out:
        shown.append(f"(left out whole to fit code.context_chars, not shown: {', '.join(out)})")
    return "\n\n".join(shown)


def edit_problems(drafts: list[ProposalDraft], ctx: PlanContext) -> str | None:
    """Why some search block does not match the current text exactly once, with that text; or None."""
    problems = []
    for i, draft in enumerate(drafts):
        files = ctx.files_for(draft.parent)
        if files is None:
            continue  # a parent with no valid version: validation refuses it at `apply`
        for edit in draft.edits:
            text = files.get(edit.file)
            if text is None:
                if edit.search:
                    problems.append(f"proposals[{i}]: {edit.file} is not an editable file "
                                    f"(files: {sorted(files)})")
                continue
            count = text.count(edit.search)
            if count != 1:
                how = "does not match" if count == 0 else f"matches {count} times"
                at = f" at {draft.parent}" if draft.parent else ""
                problems.append(f"proposals[{i}]: the search block for {edit.file}{at} {how}; it must match exactly "
                                f"once. The file's current text:\n```\n{text}\n```")
    return "\n".join(problems) or None
