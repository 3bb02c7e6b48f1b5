"""The research brief: Markdown with YAML front matter, parsed into a validated `Brief`.

A brief says what to optimise (objective metric and direction), how much may be spent (runs,
trainer steps, wall-clock, LLM tokens), what to run (base run config, sandboxes or client
entries), what may change (the search space), with which seeds, and which steps a human must
approve. Any error names the field and the line of the brief it came from.

This module only reads and validates. It does not plan, launch or talk to MLflow.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.config import ConfigError, RunConfig, load_config

# Units accepted in durations such as `wall_clock: 20m`; days matter because studies run for days.
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*$")


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

    @model_validator(mode="after")
    def _one_client_source(self) -> RunSpec:
        if self.sandboxes and self.clients:
            raise ValueError("give either sandboxes or clients, not both")
        return self


class Approval(_Strict):
    config_only: Literal["auto", "human"] = "human"  # auto: approved when it fits the remaining budget
    code_change: Literal["human"] = "human"  # code changes always need a person; nothing else is accepted


class HeuristicSettings(_Strict):
    arms: int = Field(4, ge=1)  # configurations sampled for the first rung of successive halving
    eta: int = Field(2, ge=2)  # each rung keeps the best 1/eta
    min_steps: int | None = Field(None, ge=1)  # trainer steps at rung 0; None: base steps / eta^(rungs-1)


class LlmSettings(_Strict):
    proposals_per_round: int = Field(3, ge=1)
    max_retries: int = Field(3, ge=0)  # re-asks after invalid output, each with the error fed back
    temperature: float = Field(0.7, ge=0)
    max_tokens: int = Field(1500, ge=64)  # completion cap per call


class PlannerSettings(_Strict):
    seed: int = 0  # seeds the heuristic's sampling; same seed, same results -> same proposals
    heuristic: HeuristicSettings = Field(default_factory=HeuristicSettings)
    llm: LlmSettings = Field(default_factory=LlmSettings)


class MonitorSettings(_Strict):
    poll_s: float = Field(2.0, gt=0)  # how often running core runs are checked in MLflow
    plateau_patience: int | None = Field(None, ge=2)  # stop after this many steps without improvement
    plateau_min_delta: float = Field(0.0, ge=0)
    collapse_drop: float | None = Field(0.5, gt=0)  # stop if the objective falls this fraction below its best
    divergence_metrics: list[str] = Field(default_factory=lambda: ["train/loss", "reward/mean"])


class ReviewSettings(_Strict):
    poll_s: float = Field(5.0, gt=0)  # how often a waiting study looks for decisions in MLflow


class LaunchSettings(_Strict):
    command: list[str] | None = None  # None: the `swarm run` next to this Python; a list runs instead
    concurrency: int = Field(1, ge=1)  # core runs at once
    grace_s: float = Field(10.0, ge=0)  # SIGTERM -> SIGKILL delay when stopping a run


class Brief(_Strict):
    title: str = ""
    objective: Objective
    budget: Budget = Field(default_factory=Budget)
    run: RunSpec
    search_space: dict[str, SearchParam] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0])
    approval: Approval = Field(default_factory=Approval)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    monitor: MonitorSettings = Field(default_factory=MonitorSettings)
    review: ReviewSettings = Field(default_factory=ReviewSettings)
    launch: LaunchSettings = Field(default_factory=LaunchSettings)
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


def split_front_matter(text: str) -> tuple[str, str, int]:
    """-> (yaml text, markdown body, line number where the YAML starts)."""
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        raise BriefError("line 1: a brief must start with '---' and YAML front matter")
    for i, line in enumerate(lines[1:], start=1):
        if line.strip() in ("---", "..."):
            return "".join(lines[1:i]), "".join(lines[i + 1:]), 2
    raise BriefError("line 1: the front matter is not closed by a '---' line")


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...], first_line: int) -> int | None:
    """The brief line of the YAML node at a pydantic error location (nearest existing parent)."""
    line = node.start_mark.line + first_line if node is not None else None
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    child, line = value, key.start_mark.line + first_line
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
            line = child.start_mark.line + first_line
        if child is None:
            break
        node = child
    return line


def _check_against_config(brief: Brief, workdir: Path, lines: _LineFinder) -> None:
    """Every config key the brief touches must exist in the core's run config."""
    try:
        brief.resolve_config(workdir)
    except ConfigError as e:
        raise BriefError(f"{lines('run')}run: the base config does not load: {e}") from None
    for key, param in brief.config_params().items():
        sample = param.values[0] if isinstance(param, ChoiceParam) else param.low
        try:
            brief.resolve_config(workdir, {key: sample})
        except ConfigError as e:
            raise BriefError(f"{lines('search_space', key)}search_space.{key}: not a usable run config key: "
                             f"{e}") from None


class _LineFinder:
    def __init__(self, root: yaml.Node | None, first_line: int) -> None:
        self.root, self.first_line = root, first_line

    def __call__(self, *loc: Any) -> str:
        line = _line_of(self.root, loc, self.first_line)
        return f"line {line}: " if line is not None else ""


def parse_brief(text: str, source: str = "<brief>", workdir: Path | None = None) -> Brief:
    """Parse and validate a brief. With `workdir`, config keys are also checked against the core."""
    try:
        front, body, first_line = split_front_matter(text)
    except BriefError as e:
        raise BriefError(f"{source}: {e}") from None
    try:
        root = yaml.compose(front)
        data = yaml.safe_load(front)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + first_line}: " if mark is not None else ""
        raise BriefError(f"{source}: {where}the front matter is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise BriefError(f"{source}: line {first_line}: the front matter must be a mapping")
    lines = _LineFinder(root, first_line)
    try:
        brief = Brief.model_validate({**data, "body": body.strip()})
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if p not in ("range", "choice", "code"))
            field = ".".join(str(p) for p in loc) or "<front matter>"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"  {lines(*loc)}{field}: {msg}")
        raise BriefError(f"{source}: invalid brief:\n" + "\n".join(problems)) from None
    if workdir is not None:
        try:
            _check_against_config(brief, workdir, lines)
        except BriefError as e:
            raise BriefError(f"{source}: {e}") from None
    return brief


def load_brief(path: str | Path, workdir: Path | None = None) -> Brief:
    path = Path(path)
    if not path.is_file():
        raise BriefError(f"brief {path} does not exist")
    return parse_brief(path.read_text(), str(path), workdir)
