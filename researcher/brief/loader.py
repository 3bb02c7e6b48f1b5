"""Reading a brief file: front matter split off, YAML parsed, validated into a `Brief`, errors by line.

`parse_brief`/`load_brief` are the only way a brief enters the study. Any error names the field
and the line of the brief it came from. The schema itself is `researcher.brief.schema`; this module
neither plans, launches nor talks to MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from core.config_io import ConfigError
from researcher.brief.judges import unjudged
from researcher.brief.objective import objective_problem
from researcher.brief.schema import Brief, BriefError, ChoiceParam


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
    """Every config key the brief touches must exist in the core's run config; code paths must exist."""
    for i, path in enumerate(brief.code.editable if brief.code else []):
        if not (workdir / path).exists():
            raise BriefError(f"{lines('code', 'editable', i)}code.editable: {path} does not exist in {workdir}")
    for i, path in enumerate(brief.code.readonly if brief.code else []):
        if not (workdir / path).exists():
            raise BriefError(f"{lines('code', 'readonly', i)}code.readonly: {path} does not exist in {workdir}")
    problems = unjudged(brief.code.editable, workdir) if brief.code else []
    if problems:  # a study that edits code decides only on judge scores (DESIGN §3.7)
        i, why = problems[0]
        raise BriefError(f"{lines('code', 'editable', i)}code.editable: {why}")
    try:
        cfg = brief.resolve_config(workdir)
    except ConfigError as e:
        raise BriefError(f"{lines('run')}run: the base config does not load: {e}") from None
    problem = objective_problem(brief.objective.metric, cfg, workdir) if brief.code else None
    if problem:  # a study that edits code decides only on its judges' scores (issue 38, item 5)
        raise BriefError(f"{lines('objective', 'metric')}objective.metric: {problem}")
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
