"""Review where people review: a code proposal approved, and a second one vetoed, in the MLflow UI.

A real `mlflow server` (bench/soak_procs.py `MlflowServer`), a real `--planner manual` study on the
tiny model, and Debian's chromium driven by Playwright: the test finds the proposal's run from the
experiment page, reads its hypothesis and diff there, and decides by editing the `review.*` tags in
the UI's tag editor with clicks and typing, never through MLflow's API. The study must take both
decisions up (source `mlflow`), run the approved one, and `researcher study history` must say so.

It needs chromium at /usr/bin/chromium and the `playwright` driver (`make setup` and `make test`
install both). Outside `make test` and CI it skips where either is missing; under them
(`SWARMRL_REQUIRE_BROWSER` or `CI` set) a missing browser is a failure, so a green suite means the
UI path ran. It does not test MLflow's UI itself beyond the steps a reviewer takes.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.soak_procs import MlflowServer
from researcher.study.store import experiment_name
from tests.researcher.harness import BIN, Project, letters_code
from tests.researcher.mlflow_auth import REVIEWER, start_auth_server
from tests.researcher.test_code_study import AGENT, _patch, _wait_status

# A server start (~40 s on a busy 2-core machine), validation, a smoke run and one core run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHROMIUM = Path("/usr/bin/chromium")
UI_TIMEOUT_MS = 60_000  # the UI renders slowly while the study trains beside it on two cores
STUDY = "ui"
BRIEF = """---
title: review in the MLflow UI
objective: {metric: reward/mean, direction: maximize}
budget: {max_runs: 6, max_rounds: 4}
run:
  base_config: configs/tiny.yaml
  overrides: {trainer.steps: 2, trainer.batch_groups: 1}
""" + letters_code(1) + """seeds: [0]
approval: {config_only: human, code_change: human}
launch: {concurrency: 2}
monitor: {poll_s: 0.5, collapse_drop: null}
review: {poll_s: 0.5}
---
Does a longer reply budget change the letters reward? Reviewed in the MLflow UI.
"""


def _require_browser() -> None:
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright driver (pip install -e '.[dev]')")
    if not CHROMIUM.is_file():
        missing.append(f"chromium at {CHROMIUM} (make chromium-setup)")
    if missing:
        message = "the MLflow-UI review test needs " + " and ".join(missing)
        if os.environ.get("SWARMRL_REQUIRE_BROWSER") or os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    folder = tmp_path / "mlflow"
    folder.mkdir()
    mlflow = MlflowServer(BIN / "mlflow", folder, dict(os.environ))
    mlflow.start()
    try:
        yield mlflow.uri
    finally:
        mlflow.stop()


def _screenshot(page, tmp_path: Path) -> Path:
    """The proposal's page as a reviewer sees it: kept with the test, and in SWARMRL_SCREENSHOT_DIR when set."""
    shot = tmp_path / "review-ui.png"
    page.screenshot(path=str(shot))
    if os.environ.get("SWARMRL_SCREENSHOT_DIR"):
        out = Path(os.environ["SWARMRL_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out / shot.name)
    return shot


def _open_proposal(page, url: str, pid: str) -> None:
    """From the experiment list to the proposal's run page, as a person clicks there."""
    page.goto(url + "/#/experiments")
    # MLflow 3 opens experiments in its GenAI view; proposals are runs, listed in the training view.
    page.get_by_role("button", name="Model training").click()
    # The experiment's row in the list (the sidebar also links recent experiments by name).
    page.get_by_test_id("experiment-list-item-link").and_(page.get_by_title(experiment_name(STUDY), exact=True)).click()
    page.get_by_role("link", name=f"proposal {pid}", exact=True).click()
    page.get_by_role("heading", name=f"proposal {pid}", exact=True).wait_for()


def _edit_tags(page, tags: dict[str, str]) -> None:
    """Set tags in the run page's tag editor: the key typed into its combobox, the value into its field."""
    from playwright.sync_api import expect

    page.get_by_role("button", name="Edit tags").click()
    dialog = page.get_by_role("dialog", name="Add/Edit tags")
    for key, value in tags.items():
        box = dialog.get_by_role("combobox")
        box.click()
        box.fill(key)
        page.keyboard.press("Enter")
        dialog.get_by_label("Value").fill(value)
        dialog.get_by_role("button", name="Add tag").click()
        expect(dialog).to_contain_text(f"{key}: {value}")
    dialog.get_by_role("button", name="Save tags").click()
    expect(dialog).to_be_hidden()
    for key, value in tags.items():  # the page shows what was saved
        expect(page.get_by_text(f"{key}: {value}", exact=True)).to_be_visible()


def _history_row(history: str, pid: str) -> list[str]:
    """The cells of `pid`'s row in `researcher study history`'s decisions table."""
    row = next(line for line in history.splitlines() if line.strip("│ ").startswith(pid + " "))
    return [cell.strip() for cell in row.strip().strip("│").split("│")]


def test_a_reviewer_approves_and_vetoes_proposals_in_the_mlflow_ui(tmp_path: Path, server: str) -> None:
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)
    project = Project(tmp_path, server=server)
    brief = tmp_path / "ui.md"
    brief.write_text(BRIEF)
    patch = _patch(tmp_path, "longer", AGENT, "MAX_TOKENS = 12", "MAX_TOKENS = 16")
    project.cli("start", str(brief), "--name", STUDY, "--planner", "manual", "--detach")
    try:
        project.cli("propose", STUDY, "--patch", str(patch), "--set", "trainer.lr=0.001",
                    "--hypothesis", "a longer reply budget raises the letters reward")
        project.cli("propose", STUDY, "--set", "trainer.lr=0.5", "--hypothesis", "a huge learning rate learns faster")
        for pid in ("p1", "p2"):
            assert _wait_status(project, STUDY, pid, {"pending", "invalid"}, timeout=300)["status"] == "pending"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            try:
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                context.set_default_timeout(UI_TIMEOUT_MS)
                # The assistant panel MLflow opens on a first visit would cover half the run page.
                context.add_init_script("localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
                                        "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');")
                page = context.new_page()
                _open_proposal(page, server, "p1")
                expect(page.get_by_text("Scheduled", exact=True)).to_be_visible()
                expect(page.get_by_text("review.status: pending", exact=True)).to_be_visible()
                page.get_by_role("button", name="Expand description").click()
                expect(page.get_by_text("a longer reply budget raises the letters reward").first).to_be_visible()
                # The config diff's table: key, the base config's value (configs/tiny.yaml's), the proposed one.
                expect(page.get_by_role("row", name=re.compile(r"^trainer\.lr \S+ 0\.001$"))).to_be_visible()
                expect(page.get_by_text("+MAX_TOKENS = 16")).to_be_visible()  # the diff, in the description
                _screenshot(page, tmp_path)
                # MLflow previews .log files but not .diff ones: the diff is listed, the log is read.
                page.get_by_role("tab", name="Artifacts").click()
                page.get_by_text("proposal", exact=True).click()
                page.get_by_text("code.diff", exact=True).click()
                expect(page.get_by_title("proposal/code.diff", exact=True)).to_be_visible()
                page.get_by_text("validation.log", exact=True).click()
                expect(page.get_by_text("== apply: passed", exact=False).first).to_be_visible()
                page.get_by_role("tab", name="Overview").click()
                _edit_tags(page, {"review.status": "approved"})

                # A veto's reason first: the study takes a decision up at its next poll after review.status.
                _open_proposal(page, server, "p2")
                _edit_tags(page, {"review.reason": "0.5 diverges on the tiny model", "review.by": "ada"})
                _edit_tags(page, {"review.status": "vetoed"})
            finally:
                browser.close()
        assert _wait_status(project, STUDY, "p2", {"vetoed"}, timeout=120)["status"] == "vetoed"
        assert _wait_status(project, STUDY, "p1", {"done", "failed"}, timeout=600)["status"] == "done"
        core = [r for r in project.runs(STUDY) if r.data.tags.get("swarmrl.proposal") == "p1"
                and r.data.tags.get("swarmrl.kind") not in ("code", "proposal")]
        assert [r.info.status for r in core] == ["FINISHED"]
        history = project.cli("history", STUDY, COLUMNS="400").stdout  # wide enough that no cell wraps
        approved, vetoed = _history_row(history, "p1"), _history_row(history, "p2")
        # proposal, verdict, by, when, source, why: a UI edit without review.by is `mlflow-ui`'s, seen at poll time.
        # An MLflow without authentication: the source says anyone who reached it could have written it.
        anyone = "mlflow (unauthenticated: anyone who reached it)"
        assert [approved[i] for i in (0, 1, 2, 4)] == ["p1", "approved", "mlflow-ui", anyone], history
        assert approved[3].endswith("(seen at poll time)"), history
        assert [vetoed[i] for i in (0, 1, 2, 4, 5)] == ["p2", "vetoed", "ada", anyone, "0.5 diverges on the tiny model"], \
            history
    finally:
        project.cli("stop", STUDY, "--kill-runs", check=False)


def test_a_reviewer_with_an_account_decides_in_the_ui_of_a_basic_auth_mlflow(tmp_path: Path) -> None:
    """The shared-machine set-up of docs/security.md: `mlflow server --app-name basic-auth`, the study with its
    own account (its credentials in its environment only), a reviewer logged into the UI with theirs and EDIT
    on the study's experiment. The reviewer's veto in the UI is taken up, recorded as authenticated."""
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)
    auth = start_auth_server(BIN / "mlflow", tmp_path / "mlflow")
    project = Project(tmp_path, server=auth.uri)
    creds = auth.study_env()
    brief = tmp_path / "ui.md"
    brief.write_text(BRIEF)
    try:
        project.cli("start", str(brief), "--name", STUDY, "--planner", "manual", "--detach", **creds)
        project.cli("propose", STUDY, "--set", "trainer.lr=0.5", "--hypothesis", "a huge learning rate learns faster",
                    **creds)
        assert _wait_status(project, STUDY, "p1", {"pending"}, timeout=300)["status"] == "pending"
        auth.grant(auth.experiment_id(experiment_name(STUDY)), REVIEWER[0])
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            try:
                context = browser.new_context(viewport={"width": 1400, "height": 1000},
                                              http_credentials={"username": REVIEWER[0], "password": REVIEWER[1]})
                context.set_default_timeout(UI_TIMEOUT_MS)
                context.add_init_script("localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
                                        "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');")
                page = context.new_page()
                _open_proposal(page, auth.uri, "p1")
                expect(page.get_by_text("review.status: pending", exact=True)).to_be_visible()
                _edit_tags(page, {"review.reason": "0.5 diverges on the tiny model", "review.by": REVIEWER[0]})
                _edit_tags(page, {"review.status": "vetoed"})
            finally:
                browser.close()
        assert _wait_status(project, STUDY, "p1", {"vetoed"}, timeout=180)["status"] == "vetoed"
        history = project.cli("history", STUDY, COLUMNS="400", **creds).stdout
        row = _history_row(history, "p1")
        assert [row[i] for i in (0, 1, 2, 4, 5)] == ["p1", "vetoed", REVIEWER[0], "mlflow (basic-auth account)",
                                                      "0.5 diverges on the tiny model"], history
    finally:
        project.cli("stop", STUDY, check=False, **creds)
        auth.stop()
