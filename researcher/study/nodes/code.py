"""The code nodes: set up the study's workspace, validate each code proposal, and run its code once approved.

`workspace` creates the study's git workspace on first use and records its base commit.
`validate` takes one code proposal of the round at a time (the edge loops back while any is left),
applies it on its parent's commit in a trial worktree and runs the validation steps; the result
(steps, logs, diff, commit when valid) joins the state as a `CodeVersion`. When a person must
approve code (`approval.code_change: human` without `code.execute_before_review`), only the static
steps run here: nothing of the proposal executes before review. `execute` then takes one approved
proposal with pending steps at a time, after review and before any core run, and runs them
(researcher/code/validation.py); a failure ends the proposal invalid, with its log, on the review board.
A proposal killed mid-validation is simply validated again: the trial is thrown away and commits
are deterministic. These nodes neither review nor launch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from researcher.code.validation import Validator
from researcher.runs.launcher import contain_mode
from researcher.code.lineage import parent_problem
from researcher.code.sealed import seal
from researcher.evidence.study_records import StudyRecords
from researcher.records import CodeVersion, Proposal, StepResult
from researcher.study.nodes.base import NodeBase, StudyState, dump
from researcher.study.store import private_paths


def unvalidated(study: StudyRecords) -> list[Proposal]:
    done = study.versions
    return [p for p in study.current if p.kind == "code" and p.id not in done]


def unexecuted(study: StudyRecords) -> list[tuple[Proposal, CodeVersion]]:
    """Approved code proposals of the round whose executing steps are still to run. A proposal on a parent
    was validated only once its parent was approved and executed (`parent_problem`), and the review node
    refuses the approval of one whose parent is not: none of these runs code nobody approved."""
    approved = {d.proposal_id for d in study.decisions if d.verdict == "approved"}
    known = study.versions
    return [(p, known[p.id]) for p in study.current
            if p.id in approved and p.id in known and known[p.id].passed and known[p.id].pending]


class CodeNodes(NodeBase):
    def _validator(self) -> Validator:
        ctx = self.ctx
        assert ctx.workspace is not None
        ctx.paths.trials.mkdir(parents=True, exist_ok=True)
        return Validator(ctx.workspace, ctx.brief, ctx.workdir, ctx.paths.trials, Path(sys.executable).parent / "swarm",
                         hidden=private_paths(ctx.paths, ctx.launcher.target.tracking_uri),
                         required=contain_mode(ctx.brief.containment) == "required", warm=ctx.launcher.target.warm)

    def _execute_before_review(self) -> bool:
        brief = self.ctx.brief
        return brief.approval.code_change == "auto" or bool(brief.code and brief.code.execute_before_review)

    def workspace(self, state: StudyState) -> dict[str, Any]:
        self._enter("workspace", state)
        if self.ctx.workspace is None:
            return {"workspace_base": ""}
        base = self.ctx.workspace.base()
        if base != state.get("workspace_base"):
            self.ctx.emit("workspace", path=str(self.ctx.workspace.root), base=base)
        # Before any run: every arm of every comparison is scored by these copies (researcher.code.sealed).
        sealed = seal(self.ctx.workspace, self.ctx.paths.judges, base)
        if not state.get("sealed_judges"):
            self.ctx.emit("judges.sealed", digest=sealed.digest(), sandboxes=[j.sandbox for j in sealed.judges])
        return {"workspace_base": base, "sealed_judges": sealed.model_dump()}

    def validate(self, state: StudyState) -> dict[str, Any]:
        self._enter("validate", state)
        study = self._study(state)
        todo = unvalidated(study)
        if not todo:
            return {}
        p, known = todo[0], study.versions
        ctx = self.ctx
        parent = known.get(p.parent) if p.parent else None
        problem = None
        if ctx.workspace is None:
            problem = "this study edits no code: its brief has no `code:` section"
        elif p.parent:
            problem = parent_problem(p.parent, list(study.proposals), list(study.decisions), list(known.values()))
        if problem:
            version = CodeVersion(proposal_id=p.id, parent_commit="", passed=False, failed_step="apply",
                                  steps=[StepResult(step="apply", passed=False, log=f"refused: {problem}")])
        else:
            version = self._validator().validate(p, parent.commit if parent else state["workspace_base"], ctx.emit,
                                                 execute=self._execute_before_review())
        if version.diff:
            ctx.paths.diffs.mkdir(parents=True, exist_ok=True)
            (ctx.paths.diffs / f"{p.id}.diff").write_text(version.diff)
        ctx.emit("validation", proposal_id=p.id, passed=version.passed, step=version.failed_step,
                 commit=version.commit)
        return {"code": [*state.get("code", []), *dump([version])]}

    def execute(self, state: StudyState) -> dict[str, Any]:
        self._enter("execute", state)
        todo = unexecuted(self._study(state))
        if not todo:
            return {}
        (p, version), ctx = todo[0], self.ctx
        done = self._validator().execute(p, version, ctx.emit)
        ctx.emit("validation", proposal_id=p.id, passed=done.passed, step=done.failed_step, commit=done.commit)
        if not done.passed:
            ctx.board.invalidate(p.id, done)
        code = [v if v["proposal_id"] != p.id else done.model_dump() for v in state.get("code", [])]
        return {"code": code}
