"""`launch.backend: ray` (issue 11): a study's core runs as Ray jobs on a local Ray cluster.

One cluster (with its job server) for the module. A whole study launches its runs as Ray jobs and
reads their MLflow metrics; a launcher that restarts adopts the job it submitted instead of
submitting it again, and a stop ends the job; an unreachable cluster is a failed launch with the
reason, not a crash.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from ray.job_submission import JobStatus, JobSubmissionClient

from researcher.records import Launch
from researcher.runs import ray_jobs
from researcher.runs.launcher import LaunchTarget
from researcher.runs.ray_jobs import RayJobLauncher, submission_id
from tests.ray_cluster import local_ray_cluster
from tests.researcher.harness import ROOT, SWARM, Project, write_brief

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dashboard():
    with local_ray_cluster(num_cpus=2, dashboard=True) as (_, url):
        yield url


def test_a_study_launches_its_runs_as_ray_jobs_and_reads_their_metrics(dashboard, tmp_path: Path) -> None:
    project = Project(tmp_path)
    brief = write_brief(project.tmp, rounds=1)
    text = brief.read_text().replace("launch: {concurrency: 2}",
                                     f"launch: {{concurrency: 2, backend: ray, ray_address: '{dashboard}'}}")
    brief.write_text(text)
    project.cli("start", str(brief), "--name", "rayjobs", "--planner", "heuristic", timeout=900)
    values, _, _ = project.state("rayjobs")
    launches = values["launches"]
    assert launches and all(x["status"] == "finished" for x in launches), launches
    jobs = JobSubmissionClient(dashboard)
    for x in launches:  # each run was a Ray job of its own, and it succeeded
        info = jobs.get_job_info(submission_id("rayjobs", x["key"]))
        assert info.status == JobStatus.SUCCEEDED and info.metadata["swarmrl.launch"] == x["key"]
        assert "swarm run" in info.entrypoint or str(SWARM) in info.entrypoint
        log = Path(x["log_path"]).read_text()
        assert f"Running entrypoint for job {info.submission_id}" in log  # the job's log, copied into run.log
        assert f"training {x['steps']} steps" in log
    runs = {r.data.tags.get("swarmrl.launch"): r for r in project.runs("rayjobs") if "swarmrl.launch" in r.data.tags}
    assert set(runs) == {x["key"] for x in launches}  # same tags as local runs: one MLflow run per launch
    steps = {x["key"]: x["steps"] for x in launches}
    for key, r in runs.items():
        assert r.info.status == "FINISHED" and r.data.tags["swarmrl.study"] == "rayjobs"
        history = MlflowClient(project.tracking_uri).get_metric_history(r.info.run_id, "reward/mean")
        assert [m.step for m in history] == list(range(1, steps[key] + 1))
    report = (project.studies / "rayjobs" / "report.md").read_text()
    assert all(x["key"].rsplit("-s", 1)[0] in report for x in launches)  # the study analysed what it read


def _launcher(tmp: Path, address: str, study: str = "adopt") -> RayJobLauncher:
    target = LaunchTarget(command=[str(SWARM), "run"], workdir=ROOT, tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}",
                          experiment=f"study-{study}", study=study)
    return RayJobLauncher(target, tmp / "state", grace_s=5, emit=lambda *a, **k: None, address=address)


def test_a_restarted_launcher_adopts_its_job_and_a_stop_ends_it(dashboard, tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    launch = Launch(key="p1-s0", proposal_id="p1", seed=0, steps=200, config_path="configs/tiny.yaml")
    started = _launcher(tmp_path, dashboard).start(launch, client)
    assert started.status == "running"
    again = _launcher(tmp_path, dashboard)  # a new process: nothing in memory
    adopted = again.start(launch, client)  # would fail on a second submission with the same id
    assert adopted.status == "running" and adopted.started_at == started.started_at
    jobs = JobSubmissionClient(dashboard)
    sid = submission_id("adopt", "p1-s0")
    assert sum(1 for j in jobs.list_jobs() if j.submission_id == sid) == 1
    deadline = time.monotonic() + 300
    while jobs.get_job_status(sid) != JobStatus.RUNNING and time.monotonic() < deadline:
        time.sleep(0.5)
    stopped = again.stop(adopted, "enough", client)
    assert stopped.status == "stopped" and stopped.reason == "enough"
    assert jobs.get_job_status(sid) == JobStatus.STOPPED


class _AgentNotUpYet:
    """Ray's job server before its node's agent registered (a double of the answer only): the first
    `refusals` submissions get its 500, then the real server takes them."""

    def __init__(self, server: JobSubmissionClient, refusals: int):
        self.server, self.refusals, self.asked = server, refusals, 0

    def submit_job(self, **kwargs):
        self.asked += 1
        if self.asked <= self.refusals:
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, please try again later..")
        return self.server.submit_job(**kwargs)

    def __getattr__(self, name: str):
        return getattr(self.server, name)


def test_a_job_server_whose_agent_is_not_up_yet_is_asked_again_and_takes_the_job(dashboard, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(ray_jobs, "AGENT_POLL_S", 0.05)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    launch = Launch(key="p1-s0", proposal_id="p1", seed=0, steps=2, config_path="configs/tiny.yaml")
    launcher = _launcher(tmp_path, dashboard, study="agent")
    launcher._jobs = server = _AgentNotUpYet(JobSubmissionClient(dashboard), refusals=3)
    started = launcher.start(launch, client)
    assert started.status == "running" and server.asked == 4
    sid = submission_id("agent", "p1-s0")
    assert server.get_job_info(sid).metadata["swarmrl.launch"] == "p1-s0"
    server.stop_job(sid)


def test_an_agent_that_never_comes_up_fails_the_launch_with_rays_answer(dashboard, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ray_jobs, "AGENT_WAIT_S", 0.3)
    monkeypatch.setattr(ray_jobs, "AGENT_POLL_S", 0.05)
    launch = Launch(key="p1-s0", proposal_id="p1", seed=0, steps=2, config_path="configs/tiny.yaml")
    launcher = _launcher(tmp_path, dashboard, study="noagent")
    launcher._jobs = server = _AgentNotUpYet(JobSubmissionClient(dashboard), refusals=10 ** 6)
    failed = launcher.start(launch, MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    assert failed.status == "failed" and "No available agent" in failed.reason and server.asked > 1


def test_an_unreachable_cluster_fails_the_launch_with_the_reason(tmp_path: Path) -> None:
    launch = Launch(key="p1-s0", proposal_id="p1", seed=0, steps=4, config_path="configs/tiny.yaml")
    launcher = _launcher(tmp_path, "http://127.0.0.1:9")
    failed = launcher.start(launch, MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    assert failed.status == "failed" and "Ray job server at http://127.0.0.1:9" in failed.reason
