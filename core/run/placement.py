"""The run a config's placement asks for: the plain `CoreRun` in this process, or one on Ray.

Ray placement imports `core.ray.driver` (and so `ray`) only when asked for, so a local run never
imports Ray; this is the one place outside `core.ray` that may name it. The plan and its checks are
`core.run.plan`. This module deliberately holds no placement logic of its own.
"""

from __future__ import annotations

from core.config import RunConfig
from core.run.loop import CoreRun
from core.run.plan import plan


def core_run(cfg: RunConfig) -> CoreRun:
    """The run for `cfg`'s placement: in this process, or with its models and clients as Ray actors."""
    if cfg.placement.kind == "local":
        return CoreRun(cfg)
    plan(cfg)  # the same checks as --dry-run, before anything starts
    from core.ray.driver import ray_core_run  # Ray is imported only for a Ray placement

    return ray_core_run(cfg)
