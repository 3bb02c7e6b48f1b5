"""The study report: Markdown with PNG plots and a lineage table, from the study state and MLflow.

Lineage reads hypothesis -> config diff -> code (a link to the proposal's diff and its workspace
commit, or why it failed validation) -> decision -> runs -> metric for every proposal. The
report also states the budget spent, why the study stopped, each planner's notes, the planner's
overhead against the time spent in core runs, the best configuration with its interval over
seeds, the recommended code's diff against the base commit (when the recommendation is code), the log tails of failed and stalled runs, and edits of decided review tags that were
ignored. It can be written at any time ("the study so far").
It reads; it never changes the study.
"""

from __future__ import annotations

import html
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.tracking import MlflowClient

from researcher.brief.schema import Brief
from researcher.evidence import analysis, confirmation, decision
from researcher.evidence.study_records import StudyRecords
from researcher.review.report_stages import stage_lines
from researcher.records import (
    CodeVersion,
    Cost,
    Decision,
    ExperimentResult,
    IgnoredChange,
    Launch,
    Proposal,
    SwapResult,
)
from researcher.review import report_html
from researcher.review.plain import cell, fenced, markdown, plain
from researcher.review.views import (
    best_result,  # also what `status` prints
    trained_steps as _steps,
)

if TYPE_CHECKING:  # the study's folders, passed in by the study: review sits below study/
    from researcher.study.store import StudyPaths

# How verdicts are reached, stated in every report so a reader can weigh a "better".
DECISION_RULE = (
    f"Decision rule: each candidate is compared with a reference trained as long on the same seeds that differs "
    f"from it only in what it tests (a code change: the base code with the candidate's own overrides), by a "
    f"{decision.PAIRED} on the seeds both finished ({decision.WELCH} when fewer pair up), two-sided at "
    f"alpha = {decision.ALPHA}, with Holm–Bonferroni across the candidates judged together; effects are "
    f"candidate minus baseline with their 95% CI. Fewer than {decision.MIN_SEEDS} finished seeds is inconclusive; "
    f"runs stopped early count as failed; a failed seed is re-run once, and failing again makes the proposal "
    f"incomplete. A recommendation must be `better` again on held-out seeds the search never used; an "
    f"inconclusive comparison gets seeds added in stages, each look at its group-sequential level.")
# Figure size in inches: readable in a Markdown preview at its default width.
_FIG = (7.0, 4.0)


def _text(value: object) -> str:
    """Untrusted text (a hypothesis, a planner's note, a reason typed in a tag) in the report: plain and no
    Markdown (review/plain.py); the HTML report shows the characters as typed."""
    return markdown(value)


def _span(value: object) -> str:
    """Untrusted text inside a Markdown code span: plain, and no backtick to end the span early."""
    return cell(value).replace("`", "'")


def _cell(text: str) -> str:
    """A table cell: controls escaped (review/plain.py), `|` escaped, newlines as the report's <br>."""
    return plain(text).replace("|", "\\|").replace("\n", "<br>")




def _ranking(proposals: list[Proposal], results: dict[str, ExperimentResult], brief: Brief) -> list[str]:
    """Scores grouped by training length, best first: the comparisons that are fair."""
    lines = []
    for steps in sorted({_steps(p) for p in proposals}):
        group = [(p, results[p.id]) for p in proposals if _steps(p) == steps and p.id in results
                 and results[p.id].summary and results[p.id].summary.n]  # type: ignore[union-attr]
        group.sort(key=lambda pr: pr[1].summary.mean,  # type: ignore[union-attr]
                   reverse=brief.objective.direction == "maximize")
        if group:
            shown = "; ".join(f"{p.id} `{ {k: v for k, v in p.overrides.items() if k != 'trainer.steps'} }` "
                              f"{r.summary.fmt()}" for p, r in group)  # type: ignore[union-attr]
            lines.append(f"- {steps or 'base'} steps: {shown}")
    return lines


def _curves(brief: Brief, launches: list[Launch], client: MlflowClient) -> dict[str, analysis.History]:
    by_proposal: dict[str, list[analysis.History]] = {}
    for x in launches:
        if x.run_id and x.status in ("finished", "stopped", "stalled"):
            try:
                history = analysis.read_history(client, x.run_id, brief.objective.metric)
            except Exception:  # noqa: BLE001 - a deleted run must not stop a report
                continue
            if history:
                by_proposal.setdefault(x.proposal_id, []).append(history)
    return {pid: analysis.mean_curve(hs) for pid, hs in by_proposal.items()}


@dataclass(frozen=True)
class Series:
    """One curve of `curves.png` with what it is: its label and how it is drawn."""
    curve: analysis.History
    label: str
    color: str | None  # None: matplotlib's cycle
    width: float
    style: str


def curve_series(curves: dict[str, analysis.History], proposals: dict[str, Proposal],
                 code: dict[str, CodeVersion], base_flat: dict[str, str]) -> list[Series]:
    """Each proposal's curve labelled with what it changed; the baseline black and thick, confirmations dashed.

    A reader of the legend then needs no lookup of proposal ids.
    """
    out = []
    for pid, curve in sorted(curves.items()):
        p = proposals.get(pid)
        if p is None:  # a launch whose proposal left the state: still drawn, by id
            out.append(Series(curve, pid, None, 1.5, "-"))
            continue
        diff = p.diff_text(base_flat)
        baseline = diff == "(no change: baseline)" and p.kind == "config" and p.commit is None
        changed = ", ".join(r.split(": ", 1)[0] + "=" + r.rsplit("-> ", 1)[-1] if "->" in r else r
                            for r in diff.splitlines())
        commit = p.commit or (code[pid].commit if pid in code else "")
        if p.kind == "code" or p.commit:
            changed = f"{(p.code_change or p.hypothesis)[:40]} @ {commit[:7] or 'no commit'}"
        label = f"{pid}: {'baseline' if baseline else changed}" + (" (confirmation)" if p.confirms else "")
        out.append(Series(curve, label, "black" if baseline else None, 2.5 if baseline else 1.5,
                          "--" if p.confirms else "-"))
    return out


def _plot(brief: Brief, series: list[Series], results: list[ExperimentResult],
          folder: Path) -> list[Path]:
    import matplotlib  # imported here: only reports draw, and it is slow to import

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    if series:
        fig, ax = plt.subplots(figsize=_FIG)
        for line in series:
            ax.plot([s for s, _ in line.curve], [v for _, v in line.curve], marker=".", label=line.label,
                    color=line.color, linewidth=line.width, linestyle=line.style)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(f"{brief.objective.metric} (mean over seeds)")
        ax.legend(fontsize="small", ncol=2)
        fig.tight_layout()
        fig.savefig(folder / "curves.png", dpi=100)
        plt.close(fig)
        out.append(folder / "curves.png")
    scored = [r for r in results if r.summary and r.summary.n]
    if scored:
        fig, ax = plt.subplots(figsize=_FIG)
        means = [r.summary.mean for r in scored]  # type: ignore[union-attr]
        errs = [(r.summary.ci_high - r.summary.ci_low) / 2 for r in scored]  # type: ignore[union-attr]
        ax.bar([r.proposal_id for r in scored], means, yerr=errs, capsize=4)
        ax.set_ylabel(f"{brief.objective.metric} score (95% CI)")
        ax.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        fig.savefig(folder / "scores.png", dpi=100)
        plt.close(fig)
        out.append(folder / "scores.png")
    return out


def _swap_plots(brief: Brief, swaps: list[SwapResult], folder: Path) -> list[tuple[SwapResult, Path]]:
    """One picture per hot swap: the old version before the swap, then both versions side by side after it.

    The before/after of one curve is shown, never judged: the verdict is the A/B of the steps after the swap.
    """
    import matplotlib  # imported here: only reports draw, and it is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for swap in swaps:
        sides = [(swap.before, f"{swap.from_version[:12]} before the swap", "grey", ":"),
                 (swap.old, f"{swap.from_version[:12]} (old) after", "tab:blue", "-"),
                 (swap.after, f"{swap.to_version[:12]} (new, {swap.proposal_id}) after", "tab:orange", "-")]
        drawn = [(side, label, color, style) for side, label, color, style in sides if side and side.steps]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=_FIG)
        for side, label, color, style in drawn:
            steps = sorted(side.steps)
            ax.plot(steps, [side.steps[s] for s in steps], marker=".", label=label, color=color, linestyle=style)
        if swap.step is not None:
            ax.axvline(swap.step, color="black", linewidth=1, linestyle="--", label=f"swap at step {swap.step}")
        ax.set_xlabel("trainer step of the live run")
        ax.set_ylabel(f"{brief.objective.metric} of each version's episodes")
        ax.set_title(f"hot swap {swap.n} ({swap.sandbox}): a picture; the verdict is the A/B after the swap",
                     fontsize="small")
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = folder / f"swap-{swap.n}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append((swap, path))
    return out


def _swap_section(swaps: list[tuple[SwapResult, Path]], root: Path) -> list[str]:
    if not swaps:
        return []
    lines = ["", "## Hot swaps into the live run", "",
             "Each swap is judged by an A/B inside the live run: the new and the old version serve side by side "
             "over the same steps and weights, paired by step. The curve before the swap is drawn for context only.",
             ""]
    for swap, path in swaps:
        verdict = swap.verdict.fmt() if swap.verdict else "not judged yet"
        kept = f"; kept {swap.kept[:12]}" if swap.kept else ""
        lines += [f"- swap {swap.n}, {swap.proposal_id}: {swap.from_version[:12]} -> {swap.to_version[:12]} at step "
                  f"{swap.step}: {verdict}{kept}", "", f"![swap {swap.n}]({path.relative_to(root).as_posix()})", ""]
    return lines


def _via(d: Decision) -> str:
    """How an MLflow decision's writer was known: an account of a basic-auth server, or anyone who reached it."""
    if d.source != "mlflow":
        return ""
    return " via MLflow (basic-auth account)" if d.authenticated else " via MLflow (unauthenticated)"


def _code_cell(p: Proposal, version: CodeVersion | None, paths: StudyPaths) -> str:
    """A link to the proposal's diff with its commit, or why it has none."""
    if p.kind != "code":
        return "-"
    if version is None:
        return "validating"
    diff = paths.diffs / f"{p.id}.diff"
    link = f"[diff]({diff.relative_to(paths.root).as_posix()})" if diff.is_file() else "no diff"
    if not version.passed:
        return f"{link} invalid at {version.failed_step}"
    return f"{link} (`{version.commit[:12]}`)"


def _recommended_code(found: confirmation.Recommendation, base: str, paths: StudyPaths) -> list[str]:
    """The recommended commit and its whole diff against the base commit (a chain's every edit)."""
    pick, commit = found.pick, found.commit
    if not found.recommended or pick is None or not commit or not base:
        return []
    try:
        diff = subprocess.run(["git", "-C", str(paths.workspace), "diff", base, commit], capture_output=True,
                              text=True, check=True).stdout
    except (subprocess.CalledProcessError, OSError) as e:
        diff = f"(the diff could not be read: {e})"
    return ["## Recommended code", "", f"{pick.id} at commit `{commit}` "
            f"(`researcher study checkout NAME --recommended DIR` writes it), against the base `{base[:12]}`:", "",
            fenced(diff.rstrip(), "diff"), ""]


def render(name: str, brief: Brief, state: dict[str, Any], client: MlflowClient, paths: StudyPaths,
           base_flat: dict[str, str], ignored: list[IgnoredChange] | None = None, failed: str | None = None) -> str:
    """`ignored`: edits of decided proposals' review tags (`ReviewBoard.ignored`), listed as such;
    `failed`: why the study cannot go on, shown as its status."""
    study = StudyRecords.read(state)
    proposals, decisions, launches = list(study.proposals), study.verdicts, list(study.launches)
    results = {r.proposal_id: r for r in study.results}
    spent = study.spent(gpus=brief.launch.gpus)
    code = study.versions
    series = curve_series(_curves(brief, launches, client), {p.id: p for p in proposals}, code, base_flat)
    figures = _plot(brief, series, list(results.values()), paths.figures)
    swaps = _swap_plots(brief, list(study.swaps), paths.figures)

    status = _text(failed if failed else f"stopped: {state['stop_reason']}" if state.get("stop_reason") else "in progress")
    lines = [f"# Study `{name}`" + (f": {brief.title}" if brief.title else ""), "",
             f"Objective: **{brief.objective.direction} `{brief.objective.metric}`** "
             f"(score = mean of the last {brief.objective.window} logged value(s); seeds {brief.seeds}).", "",
             f"Status: {status}; "
             f"{state.get('round', 0)} round(s), {len(proposals)} proposal(s), "
             f"{sum(1 for x in launches if x.run_id)} core run(s).", ""]
    best = best_result(study, brief)
    if best:
        p, r = best
        assert r.summary is not None
        lines += ["## Best so far", "", f"Proposal **{p.id}**: `{p.overrides}`, score {r.summary.fmt()}.", ""]
        if r.verdict is not None:
            lines += [f"Against the baseline: {r.verdict.fmt()}.", ""]
    # One walk of the decision tree: its sentence here, its commit under "Recommended code".
    found = confirmation.recommendation(proposals, list(results.values()), int(base_flat.get("trainer.steps", 0)),
                                        brief)
    lines += ["## Decision", "", found.text() + ".", "", DECISION_RULE, ""]
    if state.get("sealed_judges"):  # the one judge every arm was scored by (researcher/code/sealed.py)
        sealed = state["sealed_judges"]
        boxes = ", ".join(f"{j['sandbox']} ({len(j['files'])} files)" for j in sealed.get("judges", []))
        lines += [f"Judges: sealed at study start from base commit `{str(sealed.get('base', ''))[:12]}` ({boxes}); "
                  "every run was scored by that copy, never by the judge in the code it ran.", ""]
    lines += stage_lines(results)  # each look of a comparison that bought more seeds
    lines += _recommended_code(found, state.get("workspace_base", ""), paths)
    ranking = _ranking(proposals, results, brief)
    if ranking:
        lines += ["## Ranking by training length", "", *ranking, ""]
    lines += ["## Budget", "", "| budget | used | limit |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in spent.rows(brief)]
    notes = state.get("notes", [])
    plan_s = sum(n.get("plan_s", 0.0) for n in notes)
    lines += ["", "## Planner", ""]
    lines += [f"- round {n['round']} ({n['planner']}, {n['plan_s']:.2f} s, {n['tokens']} tokens): {_text(n['note'])}"
              for n in notes]
    lines += ["", f"Planner overhead: {plan_s:.2f} s over {len(notes)} plan(s) "
              f"({plan_s / max(1, len(notes)):.2f} s per iteration) against {spent.wall_s:.0f} s in core runs.", ""]
    lines += ["## Lineage", "",
              "| proposal | hypothesis | diff | code (commit) | decision | runs | score | verdict vs baseline |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in proposals:
        d = decisions.get(p.id)
        decision = (f"{d.verdict} by {d.by} at {d.at}" + (" (seen at poll time)" if d.at_poll_time else "")
                    + _via(d)
                    + (f": {d.reason}" if d.reason else "") if d else "pending")
        if d is None and p.id in code and not code[p.id].passed:
            decision = "not reviewed: failed validation"
        runs = ", ".join(f"{x.key} {x.status}" + (f" (`{x.run_id[:8]}`)" if x.run_id else "")
                         for x in launches if x.proposal_id == p.id) or "-"
        r = results.get(p.id)
        score = (r.summary.fmt() if r and r.summary else "-") + (f" ({r.status})" if r and r.status != "ok" else "")
        if r and r.summary:  # what the score cost: a harness that buys it with more compute says so
            score += f"; per episode: {r.cost.fmt() if r.cost else Cost().fmt()}"
        verdict = (r.verdict.fmt() if r and r.verdict else ("reference (baseline)" if r and r.status == "ok" else "-"))
        if r and r.parent_verdict:
            verdict += f"; against its parent {p.parent}: {r.parent_verdict.fmt()}"
        if r and r.confirmation:
            verdict += f"; confirmation {r.confirmation.fmt()}"
        lines.append(f"| {p.id} | {_text(p.hypothesis)} | {_text(p.diff_text(base_flat))} | "
                     f"{_cell(_code_cell(p, code.get(p.id), paths))} | {_text(decision)} | {_cell(runs)} | "
                     f"{_cell(score)} | {_cell(verdict)} |")
    if ignored:
        lines += ["", "## Review changes ignored", "",
                  "A decision is final: these later edits of decided proposals' review tags were recorded, not applied.", ""]
        lines += [f"- {c.proposal_id}: {c.decided}, then changed to `{_span(c.changed_to)}` by {_text(c.by)} at {_text(c.at)}"
                  + (" (seen at poll time)" if c.at_poll_time else "") + ": ignored" for c in ignored]
    for fig in figures:
        lines += ["", f"![{fig.stem}]({fig.relative_to(paths.root).as_posix()})"]
    lines += _swap_section(swaps, paths.root)
    failed = [x for x in launches if x.status in ("failed", "stalled")]
    if failed:
        lines += ["", "## Failed and stalled runs", ""]
        for x in failed:
            lines += [f"<details><summary>{html.escape(cell(x.key))}: {html.escape(cell(x.reason))}</summary>", "",
                      fenced(x.log_tail), "", "</details>", ""]
    return "\n".join(lines) + "\n"


def write_report(name: str, brief: Brief, state: dict[str, Any], client: MlflowClient, paths: StudyPaths,
                 base_flat: dict[str, str], ignored: list[IgnoredChange] | None = None,
                 failed: str | None = None) -> Path:
    """`failed`: why the study cannot go on, when it failed (the status line says so).
    No control character of the text it shows (hypotheses, notes, reasons, log tails, diffs) reaches the
    file: a report read with `cat` in a terminal cannot drive it (review/plain.py)."""
    markdown = plain(render(name, brief, state, client, paths, base_flat, ignored, failed))
    paths.report.write_text(markdown)
    # The same report as one HTML file with the plots inline, for readers without a Markdown viewer.
    paths.report.with_suffix(".html").write_text(report_html.to_html(markdown, paths.root, f"study {name}"))
    return paths.report
