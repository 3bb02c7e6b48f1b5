"""The research brief's schema: the pydantic models a brief's YAML front matter validates into.

A brief says what to optimise (objective metric and direction), how much may be spent (runs,
trainer steps, wall-clock, LLM tokens), what to run (base run config, sandboxes or client
entries), what may change (the search space), with which seeds, and which steps a human must
approve. Any error names the field and the line of the brief it came from.

This module only defines and checks fields; reading a file is `researcher.brief.loader`. It does not
plan, launch or talk to MLflow.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.config import RunConfig
from core.config_io import load_config

# Units accepted in durations such as `wall_clock: 20m`; days matter because studies run for days.
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*$")
# Seeds per experiment when a brief gives none. `bench/rigor.py` chose it: with 10 seeds a change
# worth 2 standard deviations of seed noise is found and replicated in >= 90% of simulated
# studies, while null changes are kept in <= 5%; with 8 detection falls below 0.9 (docs/benchmarks.md).
DEFAULT_SEEDS = 10


class BriefError(ValueError):
    """A brief that cannot be used; the message names the field and the line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def parse_duration(value: float | int | str) -> float:
    """`90`, `90s`, `20m`, `4h`, `2d` -> seconds."""
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION_RE.match(value)
        if not match:
            raise ValueError(f"{value!r} is not a duration such as 90s, 20m, 4h or 2d")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


class Objective(_Strict):
    metric: str  # an MLflow metric of the core's telemetry contract, e.g. reward/mean
    direction: Literal["maximize", "minimize"] = "maximize"
    window: int = Field(1, ge=1)  # a run's score is the mean of its last `window` logged values

    def better(self, a: float, b: float) -> bool:
        """Whether score a beats score b in this objective's direction (NaN never wins)."""
        if math.isnan(a):
            return False
        if math.isnan(b):
            return True
        return a > b if self.direction == "maximize" else a < b

    def worst(self) -> float:
        return -math.inf if self.direction == "maximize" else math.inf


class Budget(_Strict):
    max_runs: int = Field(20, ge=1)  # core runs (one per seed of each experiment)
    max_total_steps: int = Field(10_000, ge=1)  # trainer steps summed over all runs
    wall_clock: float = 4 * 3600.0  # seconds spent running experiments; time waiting for a human is free
    llm_tokens: int = Field(200_000, ge=0)  # prompt + completion tokens of the llm planner
    max_rounds: int = Field(10, ge=1)  # plan -> launch -> analyze cycles
    gpu_hours: float | None = Field(None, gt=0)  # sum of run wall time x launch.gpus; None: no limit

    @field_validator("wall_clock", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)


class RangeParam(_Strict):
    kind: Literal["range"]
    low: float
    high: float
    log: bool = False  # sample log-uniformly (learning rates)
    integer: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> RangeParam:
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be greater than low ({self.low})")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self

    def contains(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high


class ChoiceParam(_Strict):
    kind: Literal["choice"]
    values: list[Any] = Field(min_length=1)

    def contains(self, value: Any) -> bool:
        return value in self.values


class CodeArea(_Strict):
    """Part of the sandbox code a proposal may change; such changes always need a human."""

    kind: Literal["code"]
    paths: list[str] = Field(min_length=1)  # files under sandboxes/ the change may touch
    description: str = ""  # what may change and why it might help


SearchParam = Annotated[RangeParam | ChoiceParam | CodeArea, Field(discriminator="kind")]


class RunSpec(_Strict):
    base_config: str  # a core run config (YAML), relative to the folder the study starts in
    overrides: dict[str, Any] = Field(default_factory=dict)  # dotted key -> value, applied to every run
    sandboxes: list[str] = Field(default_factory=list)  # shorthand for clients [{agent: sandbox:NAME}]
    clients: list[dict[str, Any]] = Field(default_factory=list)  # full client entries; replace the base's
    # Keep one long core run going (its sandboxes as isolated clients); `hot_swap` proposals are swapped
    # into it (`swarm swap`) instead of starting runs of their own (researcher/runs/live_swaps.py).
    live: bool = False
    # Trainer steps of a hot swap's A/B (both versions serving, paired by step). `bench/rigor.py` chose
    # it: at 10 a 2-sigma change is found 99.8% of the time on a learning run, at 5 only 87%.
    swap_window: int = Field(10, ge=2)

    @model_validator(mode="after")
    def _one_client_source(self) -> RunSpec:
        if self.sandboxes and self.clients:
            raise ValueError("give either sandboxes or clients, not both")
        return self


class Approval(_Strict):
    config_only: Literal["auto", "human"] = "human"  # auto: approved when it fits the remaining budget
    # Code changes need a person by default; "auto" approves *validated* code changes within budget.
    code_change: Literal["auto", "human"] = "human"


class CodeSpec(_Strict):
    """What sandbox code the study may edit, in its own git workspace (researcher/code/workspace.py)."""

    editable: list[str] = Field(min_length=1)  # project-relative paths copied into the workspace
    readonly: list[str] = Field(default_factory=list)  # paths inside `editable` no edit may change
    smoke_model: str | None = None  # model source for the smoke run (e.g. tiny); None: the study's own
    smoke_episodes: int = Field(4, ge=1)  # debug episodes per edited sandbox; all must finish with finite rewards
    test_timeout_s: float = Field(120.0, gt=0)  # the sandbox's own tests must pass within this
    smoke_timeout_s: float = Field(300.0, gt=0)  # server start + smoke episodes must finish within this
    context_chars: int = Field(6000, ge=0)  # editable file text shown to the llm planner, in characters
    execute_before_review: bool = False  # true: import, tests and smoke run (contained) before review, not after

    @field_validator("editable", "readonly")
    @classmethod
    def _relative(cls, value: list[str]) -> list[str]:
        for path in value:
            if Path(path).is_absolute() or ".." in Path(path).parts:
                raise ValueError(f"{path!r} must be a path relative to the project, without '..'")
        return [path.rstrip("/") for path in value]

    @model_validator(mode="after")
    def _readonly_inside(self) -> CodeSpec:
        for path in self.readonly:
            if not any(path == e or path.startswith(e + "/") for e in self.editable):
                raise ValueError(f"readonly path {path!r} is not inside an editable path")
        return self


class HeuristicSettings(_Strict):
    arms: int = Field(4, ge=1)  # configurations sampled for the first rung of successive halving
    eta: int = Field(2, ge=2)  # each rung keeps the best 1/eta
    min_steps: int | None = Field(None, ge=1)  # trainer steps at rung 0; None: base steps / eta^(rungs-1)


class LlmSettings(_Strict):
    proposals_per_round: int = Field(3, ge=1)
    max_retries: int = Field(3, ge=0)  # re-asks after invalid output, each with the error fed back
    # A round that still fails is retried after a doubling backoff; the search ends after this many in a row.
    max_failed_rounds: int = Field(3, ge=1)
    failed_round_backoff_s: float = Field(5.0, ge=0)  # the first wait; then 2x, 4x ... (researcher.planner.retry)
    temperature: float = Field(0.7, ge=0)
    max_tokens: int = Field(1500, ge=64)  # completion cap per call
    history_tokens: int = Field(1500, ge=100)  # the history in the prompt is cut to this, best and newest kept


class PlannerSettings(_Strict):
    seed: int = 0  # seeds the heuristic's sampling; same seed, same results -> same proposals
    heuristic: HeuristicSettings = Field(default_factory=HeuristicSettings)
    llm: LlmSettings = Field(default_factory=LlmSettings)


class MonitorSettings(_Strict):
    poll_s: float = Field(2.0, gt=0)  # how often running core runs are checked in MLflow
    plateau_patience: int | None = Field(None, ge=2)  # stop after this many steps without improvement
    plateau_min_delta: float = Field(0.0, ge=0)
    # Stop a run whose objective falls this fraction below its best and stays there; None (the default): never.
    # Off by default: RL curves dip and recover (a documented smollm2 run that reached 1.1 would have been
    # stopped at step 6 at 0.5), and a collapse stop is a failed seed, never re-run.
    collapse_drop: float | None = Field(None, gt=0)
    divergence_metrics: list[str] = Field(default_factory=lambda: ["train/loss", "reward/mean"])
    stall_s: float | None = None  # a run that logs no new metric for this long is stopped as `stalled` (e.g. 10m)

    @field_validator("stall_s", mode="before")
    @classmethod
    def _stall(cls, value: Any) -> float | None:
        return None if value is None else parse_duration(value)


class ReviewSettings(_Strict):
    poll_s: float = Field(5.0, gt=0)  # how often a waiting study looks for decisions in MLflow


class ConfirmSettings(_Strict):
    """The confirmation round before a recommendation (researcher/evidence/confirmation.py)."""

    enabled: bool = True  # off: the search's `better` verdict is recommended unconfirmed, and the report says so
    seeds: int | None = Field(None, ge=2)  # held-out seeds per arm; None: as many as the search used


class ReplicateSettings(_Strict):
    """Seeds added in stages to an inconclusive comparison (researcher/evidence/stages.py)."""

    # On: an inconclusive search pick or confirmation gets more seeds while the budget pays for them.
    enabled: bool = True
    stage_seeds: int | None = Field(None, ge=2)  # seeds per arm each stage adds; None: as many as its first look
    # The most looks at one comparison, its first included: the group-sequential design's plan, cut to what
    # the budget can pay when the comparison starts. 4 looks take a 3-seed start to 12 seeds, where a 2-sigma
    # change is found >= 90% of the time (bench/rigor.py, adaptive_detection_3seeds).
    max_looks: int = Field(4, ge=2)
    # How the error rate is spent across the looks (researcher/evidence/sequential.py): O'Brien–Fleming keeps
    # nearly all of it for the last look (little power lost there), Pocock spends it evenly (earlier stops).
    boundary: Literal["obrien_fleming", "pocock"] = "obrien_fleming"


class LaunchSettings(_Strict):
    command: list[str] | None = None  # None: the `swarm run` next to this Python; a list runs instead
    concurrency: int = Field(1, ge=1)  # core runs at once
    grace_s: float = Field(10.0, ge=0)  # SIGTERM -> SIGKILL delay when stopping a run
    run_timeout: float | None = None  # a run still going after this long is stopped as `timeout` (e.g. 2h)
    gpus: int = Field(0, ge=0)  # GPUs each run requests; GPU-hours = wall time x gpus (0 on CPU)
    # local: each run is a `swarm run` process here; ray: a Ray job (the Jobs API) on the cluster below,
    # with the same command line, tags, monitoring and adoption (researcher/runs/ray_jobs.py).
    backend: Literal["local", "ray"] = "local"
    ray_address: str = "http://127.0.0.1:8265"  # the cluster's dashboard (job server), for backend ray

    @field_validator("run_timeout", mode="before")
    @classmethod
    def _timeout(cls, value: Any) -> float | None:
        return None if value is None else parse_duration(value)


class Brief(_Strict):
    title: str = ""
    objective: Objective
    budget: Budget = Field(default_factory=Budget)
    run: RunSpec
    search_space: dict[str, SearchParam] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: list(range(DEFAULT_SEEDS)))
    approval: Approval = Field(default_factory=Approval)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    monitor: MonitorSettings = Field(default_factory=MonitorSettings)
    review: ReviewSettings = Field(default_factory=ReviewSettings)
    launch: LaunchSettings = Field(default_factory=LaunchSettings)
    confirm: ConfirmSettings = Field(default_factory=ConfirmSettings)
    replicate: ReplicateSettings = Field(default_factory=ReplicateSettings)
    code: CodeSpec | None = None  # None: the study changes configs only
    # How proposal code runs (validation's executing steps, core runs' clients, hot-swapped clients):
    # `required` (the default) needs bubblewrap and refuses to run it without; `auto`, set on purpose, runs
    # it without bubblewrap where it is missing, giving up what docs/security.md lists (the warning says it).
    containment: Literal["required", "auto"] = "required"
    body: str = ""  # the Markdown after the front matter: background for the llm planner and the report

    @field_validator("seeds", mode="before")
    @classmethod
    def _seed_count(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError("seeds must be a positive count or a list of seeds")
            return list(range(value))
        return value

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if not value or len(set(value)) != len(value):
            raise ValueError("seeds must be a non-empty list of distinct integers")
        return value

    @model_validator(mode="after")
    def _code_policy(self) -> Brief:
        if self.approval.code_change == "auto" and self.code is None:
            raise ValueError("approval.code_change: auto approves validated code changes, but the brief has no "
                             "code: section naming what may be edited")
        return self

    def config_params(self) -> dict[str, RangeParam | ChoiceParam]:
        return {k: v for k, v in self.search_space.items() if not isinstance(v, CodeArea)}

    def code_areas(self) -> dict[str, CodeArea]:
        return {k: v for k, v in self.search_space.items() if isinstance(v, CodeArea)}

    def base_overrides(self) -> list[str]:
        """The brief's own changes to the base config, as `key=value` overrides."""
        out = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
               for k, v in self.run.overrides.items()]
        clients = self.run.clients or [{"agent": f"sandbox:{name}"} for name in self.run.sandboxes]
        if clients:
            out.append("clients=" + yaml.safe_dump(clients, default_flow_style=True).strip())
        return out

    def resolve_config(self, workdir: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
        """The run config of one experiment: base config + brief overrides + the experiment's."""
        extra = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                 for k, v in (overrides or {}).items()]
        return load_config(self.base_config_path(workdir), self.base_overrides() + extra)

    def base_config_path(self, workdir: Path) -> Path:
        path = Path(self.run.base_config)
        return path if path.is_absolute() else workdir / path
