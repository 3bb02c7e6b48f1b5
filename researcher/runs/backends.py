"""Which launcher a study's core runs go through (`launch.backend`), and stopping all of a study's runs.

`local` runs are `swarm run` subprocesses (`researcher.runs.launcher`); `ray` runs are Ray jobs
(`researcher.runs.ray_jobs`, built on the local launcher's intents and argv). This module only chooses
between the two; it starts nothing itself and reads no metrics. Ray's job client is imported only
when a study uses Ray: it costs start-up time that local studies should not pay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from researcher.runs.launcher import Emit, Launcher, LaunchTarget, stop_local, write_json
from researcher.code.workspace import Workspace


def make_launcher(settings: Any, target: LaunchTarget, state_dir: Path, emit: Emit,
                  workspace: Workspace | None = None) -> Launcher:
    """The launcher for `launch.backend` (a brief's LaunchSettings): local processes, or Ray jobs."""
    if settings.backend == "ray":
        from researcher.runs.ray_jobs import RayJobLauncher  # Ray's job client: only for Ray studies (start-up)

        return RayJobLauncher(target, state_dir, settings.grace_s, emit, workspace,
                              address=settings.ray_address, gpus=settings.gpus)
    return Launcher(target, state_dir, settings.grace_s, emit, workspace)


def stop_all(state_dir: Path, reason: str, grace_s: float) -> list[str]:
    """Stop every live run of a study from its launch intents (for `researcher study stop --kill-runs`).

    The reason is written first, so the study reports these runs as stopped when it resumes.
    """
    stopped = []
    for path in sorted((state_dir / "launches").glob("*.json")):
        intent = json.loads(path.read_text())
        if intent.get("submission_id"):  # a Ray job (launch.backend ray): the cluster stops it
            from researcher.runs.ray_jobs import stop_job  # Ray's job client: only for Ray studies (start-up)

            if "stop_reason" not in intent:
                write_json(path, {**intent, "stop_reason": reason})
            if stop_job(intent["ray_address"], intent["submission_id"]):
                stopped.append(intent["key"])
        elif stop_local(path, intent, reason, grace_s):
            stopped.append(intent["key"])
    return stopped
