"""What the llm planner is told about code, and how its search/replace edits are checked.

`describe_code` renders the editable files (already cut to the brief's `code.context_chars`),
the reply format of an edit, and the earlier code proposals with their diffs, validation
outcome and log tails, so the model learns from what failed. `edit_problems` checks each
proposed block against the current text (exact, exactly once): a problem goes back to the model
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
    files = "\n\n".join(f"## {name}\n```\n{text}\n```" for name, text in ctx.code_files.items())
    history = []
    for v in ctx.code:
        outcome = f"valid, commit {v.commit[:12]}" if v.passed else f"INVALID at {v.failed_step}"
        detail = v.diff[:_HISTORY_CHARS] if v.passed else v.log()[-_HISTORY_CHARS:]
        history.append(f"- {v.proposal_id}: {outcome}\n{detail}")
    return (f"# Code you may edit\nEditable: {spec.editable}; read-only: {spec.readonly}.\n"
            f"A code proposal adds {EDIT_FORMAT} to its object (and needs_code_change=true): each search text "
            "must occur exactly once in the file. Set \"parent\" to an earlier valid proposal id to build on "
            "its code." + (" This study keeps a live run: add \"mode\": \"hot_swap\" to swap the change into it "
                          "(judged on the reward just before and after the swap) instead of new runs."
                          if ctx.brief.run.live else "") + "\n\n" + files + ("\n\n# Earlier code proposals\n" + "\n".join(history) if history else ""))


def edit_problems(drafts: list[ProposalDraft], ctx: PlanContext) -> str | None:
    """Why some search block does not match the current text exactly once, with that text; or None."""
    problems = []
    for i, draft in enumerate(drafts):
        if draft.parent:
            continue  # edits on another proposal's version are checked when they are validated
        for edit in draft.edits:
            text = ctx.code_files.get(edit.file)
            if text is None:
                if edit.search:
                    problems.append(f"proposals[{i}]: {edit.file} is not an editable file "
                                    f"(files: {sorted(ctx.code_files)})")
                continue
            count = text.count(edit.search)
            if count != 1:
                how = "does not match" if count == 0 else f"matches {count} times"
                problems.append(f"proposals[{i}]: the search block for {edit.file} {how}; it must match exactly "
                                f"once. The file's current text:\n```\n{text}\n```")
    return "\n".join(problems) or None
