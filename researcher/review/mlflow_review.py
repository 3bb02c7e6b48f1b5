"""The review surface: proposals as MLflow runs a person approves or vetoes, and the audit trail.

Each proposal becomes one MLflow run in the study's experiment, in `SCHEDULED` status, tagged
`swarmrl.proposal=<id>` and `review.status=pending`, with the hypothesis, rationale, expected
effect and config diff as tags, and a description note (`mlflow.note.content`) that reads at a
glance in the MLflow UI: those, the config diff as a table of base and proposed values, and how to
approve or veto (in the UI or with the CLI). A decision is the tag
`review.status` turned to `approved` or `vetoed`, written either by `researcher study approve/veto`
(with `review.by`, `review.reason`, `review.at`, `review.source` in the same batch) or by hand in
the MLflow UI. A waiting study polls these tags. A UI decision is recorded with the reviewer's
`review.by`/`review.at` when set, else as `mlflow-ui` at the time the study saw it, labelled so
(`at_poll_time`). A decision is final: a decided proposal cannot be decided again. A later edit of
a decided proposal's tags (say `approved` turned to `vetoed` in the UI) is recorded on its run as
`review.ignored.<n>` (what it was changed to, by whom, when: the edit's own `review.by`/`review.at`
when set, else `mlflow-ui` at the time it was seen) and the decision's tags are put back.

A code proposal's run is tagged `swarmrl.kind=code` and carries its diff as the artifact
`proposal/code.diff` and its validation log as `proposal/validation.log`; one that failed validation is
published as `review.status=invalid` and ended FAILED, so nobody is asked to review it.

It reads and writes MLflow runs; it does not wait, plan or launch.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import httpx
from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.tracking import MlflowClient

from researcher.code.lineage import Lineage
from researcher.records import CodeVersion, Decision, IgnoredChange, Proposal, Summary, now_iso
from researcher.review.plain import cell, fenced, markdown, plain

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 10.0  # `authenticated()`'s one request without credentials
# MLflow rejects longer tag values; keep notes readable rather than fail.
_MAX_TAG = 5000
STATUS = "review.status"
VERDICTS = ("approved", "vetoed")
INVALID = "invalid"  # a code proposal that failed validation: never reviewed
KINDS = ("proposal", "code")  # swarmrl.kind of proposal runs: config proposals, code proposals
IGNORED = "review.ignored."  # + n: JSON of the n-th change of a decided proposal's tags (an IgnoredChange)


class ReviewError(ValueError):
    """A decision that cannot be recorded; nothing was written."""


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TAG else text[: _MAX_TAG - 1] + "…"


# The code diff shown inline in the note; the whole of it is the artifact DIFF_ARTIFACT.
_NOTE_DIFF_CHARS = 2500
DIFF_ARTIFACT = "proposal/code.diff"
BASE_DIFF_ARTIFACT = "proposal/base.diff"  # a proposal on a parent: the whole chain's change against the base
LOG_ARTIFACT = "proposal/validation.log"


def _cell(value: object) -> str:
    """Text for the note, one line: controls and Markdown punctuation escaped (review/plain.py), so it is no
    markup, a `|` cannot end a table cell and a newline cannot end a row."""
    return markdown(value)


def _code(value: object) -> str:
    """Text inside a Markdown code span of a table cell: controls escaped, no backtick to end the span early,
    `|` escaped (GitHub-flavoured tables split cells on it even inside a span)."""
    return cell(value).replace("`", "'").replace("|", "\\|")


def config_table(p: Proposal, base: dict[str, str]) -> str:
    """The proposal's overrides that change the base config, as a Markdown table (key | base | proposed)."""
    rows = [f"| `{_code(k)}` | {_cell(base.get(k, '(unset)'))} | {_cell(v)} |"
            for k, v in sorted(p.overrides.items()) if base.get(k) != str(v)]
    if not rows:
        return "No config change."
    return "\n".join(["| key | base value | proposed value |", "|---|---|---|", *rows])


def how_to_decide(study: str, proposal_id: str) -> str:
    """The two ways to decide, for the note: the MLflow UI's tag editor and the CLI."""
    return (f"**How to decide** (the study takes the decision up at its next check):\n\n"
            f"- *In this MLflow UI:* edit this run's tags. For a veto first add `review.reason` (why: it feeds "
            f"the next plan), optionally `review.by` (your name); then set `review.status` to `approved` or "
            f"`vetoed`. A decision is final.\n"
            f"- *From a shell:* `researcher study approve {study} {proposal_id}` or "
            f"`researcher study veto {study} {proposal_id} --reason \"...\"`.")


def _note(p: Proposal, study: str, base: dict[str, str], code: CodeVersion | None = None,
          chained: Lineage | None = None) -> str:
    """The run's description (`mlflow.note.content`): what the proposal is, what it changes, how to decide.
    Its text is the planner's or a person's: control characters are escaped (review/plain.py) and each
    field is one plain line, so what the reviewer reads is what the study stored."""
    parts = [f"### Proposal {_cell(p.id)} (round {p.round}, {_cell(p.planner)})", f"**Hypothesis:** {_cell(p.hypothesis)}",
             f"**Rationale:** {_cell(p.rationale or '-')}", f"**Expected effect:** {_cell(p.expected_effect or '-')}",
             f"**Config diff:**\n\n{config_table(p, base)}"]
    if p.code_change:
        parts.append(f"**Code change:** {_cell(p.code_change)}")
    if code is not None:
        state = f"validated, commit {code.commit[:12]}" if code.passed else f"INVALID at step {code.failed_step}"
        chain, base_diff = (chained.chain, chained.base_diff) if chained is not None else ([], "")
        if chain:
            parts.append(f"**Built on:** base → {' → '.join(_cell(c) for c in chain)} → {_cell(p.id)}. "
                         "Approving it approves the whole chain's code: the cumulative diff against the base "
                         f"commit is below, and the artifact `{BASE_DIFF_ARTIFACT}`.")
        shown = _cut(base_diff or code.diff)
        what = "cumulative diff against the base commit" if base_diff else "diff"
        parts.append(f"**Code ({state}; {code.checks()}):** the whole {what} is the artifact "
                     f"`{BASE_DIFF_ARTIFACT if base_diff else DIFF_ARTIFACT}`, the validation log "
                     f"`{LOG_ARTIFACT}`.\n{fenced(shown, 'diff')}")
    if code is None or code.passed:
        parts.append(how_to_decide(study, p.id))
    return _clip("\n\n".join(parts))


def _cut(diff: str) -> str:
    return diff if len(diff) <= _NOTE_DIFF_CHARS else diff[:_NOTE_DIFF_CHARS] + "\n… (cut here)"


class ReviewBoard:
    """Proposals and decisions of one study, on its MLflow experiment."""

    def __init__(self, client: MlflowClient, experiment: str, study: str, artifacts: Path | None = None) -> None:
        """`artifacts`: where a new experiment keeps its artifacts (a local store's default is ./mlruns
        of whichever folder a run starts in; a study keeps its own with it)."""
        self.client, self.study = client, study
        found = client.get_experiment_by_name(experiment)
        if found is None:
            location = artifacts.resolve().as_uri() if artifacts is not None else None
            self.experiment_id = client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = found.experiment_id
        self._authenticated: bool | None = None  # `authenticated()`, asked once

    def _runs(self, extra: str = "") -> list:
        runs = []
        for kind in KINDS:
            query = f"tags.`swarmrl.study` = '{self.study}' AND tags.`swarmrl.kind` = '{kind}'" + extra
            runs += self.client.search_runs([self.experiment_id], filter_string=query,
                                            run_view_type=ViewType.ACTIVE_ONLY, max_results=10_000)
        return runs

    def find(self, proposal_id: str):  # -> mlflow Run | None
        runs = self._runs(f" AND tags.`swarmrl.proposal` = '{proposal_id}'")
        return min(runs, key=lambda r: r.info.start_time) if runs else None

    def publish(self, p: Proposal, base: dict[str, str], code: CodeVersion | None = None,
                chained: Lineage | None = None) -> str:
        """Create the proposal's SCHEDULED run, or return the one an earlier attempt created.

        `base`: the study's flattened base config, which the proposal's overrides are shown against;
        `chained`: a proposal on a parent's chain and cumulative diff (the note and `proposal/base.diff`)."""
        run = self.find(p.id)
        if run is None:
            diff = p.diff_text(base)
            invalid = code is not None and not code.passed
            tags = {"swarmrl.kind": "code" if p.kind == "code" else "proposal", "swarmrl.study": self.study,
                    "swarmrl.proposal": p.id, STATUS: INVALID if invalid else "pending",
                    "review.hypothesis": _clip(cell(p.hypothesis)),
                    "review.rationale": _clip(cell(p.rationale)), "review.expected_effect": _clip(cell(p.expected_effect)),
                    "review.diff": _clip(plain(diff)), "review.priority": str(p.priority),
                    "review.needs_code_change": str(p.needs_code_change).lower(),
                    "review.planner": p.planner, "mlflow.note.content": _note(p, self.study, base, code, chained)}
            if chained is not None and chained.chain:
                tags["review.chain"] = " -> ".join(["base", *chained.chain, p.id])
            if code is not None:
                tags.update({"swarmrl.sandbox_version": code.commit, "validation.passed": str(code.passed).lower(),
                             "validation.step": code.failed_step or "",
                             "validation.ran": ",".join(s.step for s in code.steps),
                             "validation.pending": ",".join(code.pending)})
                if invalid:
                    tags["review.outcome"] = _clip(f"invalid: failed validation at step {code.failed_step}")
            run = self.client.create_run(self.experiment_id, tags=tags, run_name=f"proposal {p.id}")
            params = [Param(k, _clip(str(v))) for k, v in sorted(p.overrides.items())]
            if params:
                self.client.log_batch(run.info.run_id, params=params)
            if code is not None:
                self.client.log_text(run.info.run_id, code.diff, DIFF_ARTIFACT)
                if chained is not None and chained.base_diff:
                    self.client.log_text(run.info.run_id, chained.base_diff, BASE_DIFF_ARTIFACT)
                self.client.log_text(run.info.run_id, code.log(), LOG_ARTIFACT)
                if invalid:
                    self.client.set_terminated(run.info.run_id, status="FAILED")
                    return run.info.run_id
        if run.info.status == "RUNNING" and run.data.tags.get(STATUS, "pending") == "pending":
            self.client.update_run(run.info.run_id, status="SCHEDULED")
        return run.info.run_id

    def decide(self, d: Decision) -> None:
        """Record a decision on the proposal's run; refuses a second decision on the same proposal."""
        run = self.find(d.proposal_id)
        if run is None:
            raise ReviewError(f"proposal {d.proposal_id} is not on the review board of study {self.study}")
        current = run.data.tags.get(STATUS, "pending")
        if current == INVALID:
            raise ReviewError(f"proposal {d.proposal_id} failed validation; there is nothing to decide "
                              f"(see `researcher study show {self.study} {d.proposal_id}`)")
        if current in VERDICTS:
            same = current == d.verdict and run.data.tags.get("review.by") == d.by
            if same:
                return  # a repeated write of the same decision (a resumed node) is harmless
            raise ReviewError(f"proposal {d.proposal_id} is already {current} by "
                              f"{run.data.tags.get('review.by', '?')}; a decision is final")
        tags = [RunTag("review.by", d.by), RunTag("review.at", d.at), RunTag("review.reason", _clip(d.reason)),
                RunTag("review.source", d.source), RunTag(STATUS, d.verdict)]
        self.client.log_batch(run.info.run_id, tags=tags)
        if d.verdict == "vetoed":
            self.client.set_terminated(run.info.run_id, status="KILLED")

    def overrule(self, veto: Decision, refused: Decision | None = None) -> None:
        """The study's own veto of a proposal (its parent is not approved and executed, or was vetoed): written
        over a pending status or a person's approval, which is kept in `review.refused` with why it could
        not stand. Nothing else may replace a decision on the board."""
        run = self.find(veto.proposal_id)
        if run is None:
            return
        tags = [RunTag("review.by", veto.by), RunTag("review.at", veto.at), RunTag("review.reason", _clip(veto.reason)),
                RunTag("review.source", veto.source), RunTag(STATUS, veto.verdict)]
        if refused is not None:
            tags.append(RunTag("review.refused", _clip(f"{refused.verdict} by {refused.by} at {refused.at}: refused, "
                                                      f"{veto.reason}")))
        self.client.log_batch(run.info.run_id, tags=tags)
        if self.client.get_run(run.info.run_id).info.status in ("SCHEDULED", "RUNNING"):
            self.client.set_terminated(run.info.run_id, status="KILLED")

    def authenticated(self) -> bool:
        """Whether the tracking server refuses a request without credentials (`mlflow server --app-name
        basic-auth`), so only its accounts can write a decision. A local store authenticates no one."""
        if self._authenticated is None:
            uri = self.client.tracking_uri
            self._authenticated = False
            if uri.startswith(("http://", "https://")):
                try:  # no credentials on purpose: what anyone who reaches the port would get
                    answer = httpx.get(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get",
                                       params={"experiment_id": self.experiment_id}, timeout=_PROBE_TIMEOUT_S)
                    self._authenticated = answer.status_code == 401
                except httpx.HTTPError:
                    self._authenticated = None  # unknown: asked again next time
                    return False
        return self._authenticated

    def collect(self, pending: list[str]) -> list[Decision]:
        """Decisions present on MLflow for the given pending proposals (from the CLI or the UI)."""
        wanted, found = set(pending), []
        for run in self._runs():
            tags = run.data.tags
            pid = tags.get("swarmrl.proposal", "")
            if pid not in wanted:
                continue
            status = tags.get(STATUS, "pending").strip().lower()
            if status in VERDICTS:
                at = tags.get("review.at", "").strip()
                source = tags.get("review.source") or "mlflow"
                found.append(Decision(proposal_id=pid, verdict=status,  # type: ignore[arg-type]
                                      by=tags.get("review.by") or "mlflow-ui", at=at or now_iso(), at_poll_time=not at,
                                      reason=tags.get("review.reason", ""), source=source,
                                      authenticated=self.authenticated()))
            elif status != "pending" and tags.get("review.error", "").find(repr(status)) < 0:
                message = f"unknown review.status {status!r}: set it to approved or vetoed"
                log.warning("proposal %s: %s", pid, message)
                self.client.set_tag(run.info.run_id, "review.error", message)
        return sorted(found, key=lambda d: d.proposal_id)

    def audit(self, decided: list[Decision]) -> list[IgnoredChange]:
        """Record, once each, the edits of decided proposals' tags that disagree with their decision.

        The decision's tags are put back after the edit is recorded, so each edit is recorded once
        and MLflow keeps showing the decision that stands. Returns the edits recorded now.
        """
        by_id, found = {d.proposal_id: d for d in decided}, []
        for run in self._runs():
            tags = run.data.tags
            d = by_id.get(tags.get("swarmrl.proposal", ""))
            if d is None:
                continue
            status = tags.get(STATUS, "pending").strip().lower()
            tag_by, tag_at = tags.get("review.by", "").strip(), tags.get("review.at", "").strip()
            # A UI decision without review.by/review.at was taken as `mlflow-ui` at poll time: an empty tag agrees.
            if status == d.verdict and tag_by in ("", d.by) and tag_at in ("", d.at):
                continue
            new_by, new_at = tag_by not in ("", d.by), tag_at not in ("", d.at)
            change = IgnoredChange(proposal_id=d.proposal_id, decided=d.verdict, changed_to=status,
                                   by=tag_by if new_by else "mlflow-ui", at=tag_at if new_at else now_iso(),
                                   at_poll_time=not new_at)
            n = 1 + sum(1 for k in tags if k.startswith(IGNORED))
            log.warning("proposal %s is %s; the later change of its tags to %r by %s is ignored: a decision is final",
                        d.proposal_id, d.verdict, status, change.by)
            self.client.log_batch(run.info.run_id, tags=[
                RunTag(f"{IGNORED}{n}", change.model_dump_json()), RunTag(STATUS, d.verdict),
                RunTag("review.by", d.by), RunTag("review.at", d.at), RunTag("review.reason", _clip(d.reason)),
                RunTag("review.source", d.source)])
            found.append(change)
        return found

    def ignored(self) -> list[IgnoredChange]:
        """Every recorded change of a decided proposal's tags, by proposal, oldest first."""
        rows = []
        for run in self._runs():
            for key, value in run.data.tags.items():
                if key.startswith(IGNORED) and key[len(IGNORED):].isdigit():
                    rows.append((run.data.tags.get("swarmrl.proposal", ""), int(key[len(IGNORED):]),
                                 IgnoredChange.model_validate(json.loads(value))))
        return [change for _, _, change in sorted(rows, key=lambda r: r[:2])]

    def close(self, proposal_id: str, summary: Summary | None, status: str = "FINISHED",
              reason: str = "") -> None:
        """After analysis (or when it cannot run): the proposal's result, and a terminal status."""
        run = self.find(proposal_id)
        if run is None:
            return
        run_id = run.info.run_id
        if reason:
            self.client.set_tag(run_id, "review.outcome", _clip(reason))
        if summary is not None and summary.n:
            stamp = int(time.time() * 1000)
            metrics = [Metric(f"study/objective_{k}", float(getattr(summary, k)), stamp, 0)
                       for k in ("mean", "std", "ci_low", "ci_high")
                       if math.isfinite(getattr(summary, k))]  # one seed has no std or interval
            self.client.log_batch(run_id, metrics=metrics + [Metric("study/seeds", float(summary.n), stamp, 0)])
        if self.client.get_run(run_id).info.status in ("SCHEDULED", "RUNNING"):
            self.client.set_terminated(run_id, status=status)

    def invalidate(self, proposal_id: str, code: CodeVersion) -> None:
        """An approved code proposal whose code failed a step run after approval: it ends FAILED, with its
        log; the decision stands (its tags stay), the outcome says why nothing runs."""
        run = self.find(proposal_id)
        if run is None:
            return
        run_id = run.info.run_id
        self.client.log_batch(run_id, tags=[
            RunTag("validation.passed", "false"), RunTag("validation.step", code.failed_step or ""),
            RunTag("validation.ran", ",".join(s.step for s in code.steps)), RunTag("validation.pending", ""),
            RunTag("review.outcome", _clip(f"invalid: failed validation at step {code.failed_step} after approval"))])
        self.client.log_text(run_id, code.log(), LOG_ARTIFACT)
        if self.client.get_run(run_id).info.status in ("SCHEDULED", "RUNNING"):
            self.client.set_terminated(run_id, status="FAILED")

    def mark_running(self, proposal_id: str) -> None:
        run = self.find(proposal_id)
        if run is not None and run.info.status == "SCHEDULED":
            self.client.update_run(run.info.run_id, status="RUNNING")

    def board(self) -> list[dict[str, str]]:
        """Every proposal of the study with its review tags, for `review`, `status` and `history`."""
        rows = []
        for run in sorted(self._runs(), key=lambda r: r.data.tags.get("swarmrl.proposal", "")):
            tags = run.data.tags
            rows.append({"id": tags.get("swarmrl.proposal", ""), "status": tags.get(STATUS, "pending"),
                         "run_status": run.info.status, "run_id": run.info.run_id,
                         "hypothesis": tags.get("review.hypothesis", ""), "diff": tags.get("review.diff", ""),
                         "by": tags.get("review.by", ""), "at": tags.get("review.at", ""),
                         "reason": tags.get("review.reason", ""), "error": tags.get("review.error", "")})
        return rows
