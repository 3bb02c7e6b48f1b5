"""A run config read in and written down: YAML and `--set key=value` overrides in, redacted and flat out.

`load_config` turns a YAML file (or a dict) plus overrides into a validated `core.config.RunConfig`,
and every way it can fail is a `ConfigError` naming the offending key. It is also the one home of
what counts as a credential (`is_secret` for environment names, `SECRET_FIELDS` for config fields),
read by everything that keeps secrets from agent code or writes a config down (`redacted`, `flatten`).
It is deliberately not the schema: the models and every default live in `core.config`, which this
module only reads; it starts and contains nothing (`core.contain.contained` does).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from core.config import ModelConfig, RunConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending key."""


def _format_validation(err: ValidationError, origin: str) -> str:
    lines = [f"invalid run config {origin}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-4` -> (["trainer", "lr"], 1e-4); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like dotted.key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(path[:-1]):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"override {text!r}: {'.'.join(path[: i + 1])} is not a valid list index")
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"override {text!r}: {'.'.join(path[: i + 1])} is not a section")
        last = path[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(f"override {text!r}: {last} is not a valid list index")
            node[int(last)] = value
        else:
            node[last] = value
    return data


def load_config(source: str | Path | dict[str, Any] | None = None, overrides: list[str] = ()) -> RunConfig:
    """Load a run config from a YAML path (or a dict), apply `key=value` overrides, validate."""
    origin = "(defaults)"
    data: dict[str, Any] = {}
    if isinstance(source, dict):
        data, origin = source, "(dict)"
    elif source is not None:
        path = Path(source)
        origin = str(path)
        if not path.is_file():
            raise ConfigError(f"run config {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"run config {path} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"run config {path} must be a mapping at the top level")
    data = apply_overrides(_plain(data), list(overrides))
    if "models" not in data:
        data["models"] = [ModelConfig().model_dump()]
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, origin)) from None
    if source is not None and not isinstance(source, dict):
        cfg._source_file = Path(source).resolve()
    return cfg


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(yaml.safe_dump(data))  # a deep copy that keeps only YAML types


# Environment variable names that hold credentials: never passed to agent or proposal code
# (`core.contain.contained`), and stripped from the environment of a core run of proposal code.
_SECRET_NAME = re.compile(r"(_API_KEY|_TOKEN|_SECRET|_PASSWORD|_CREDENTIALS?)$|_SECRET_|^(AWS|GOOGLE|AZURE|GCP)_|"
                          r"^MLFLOW_TRACKING_(USERNAME|PASSWORD|TOKEN|CLIENT_CERT_PATH|SERVER_CERT_PATH|INSECURE_TLS)$|"
                          r"^SWARMRL_ADMIN_TOKEN$", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    return bool(_SECRET_NAME.search(name))


# Config fields that are credentials, as (section, field): `redacted` blanks them wherever a config
# is written down (MLflow params, checkpoint manifests), so a shared run never shares its token.
SECRET_FIELDS = (("server", "admin_token"),)
REDACTED = "<redacted>"


def redacted(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a dumped run config whose set credentials read REDACTED (unset ones stay None)."""
    out = dict(data)
    for section, name in SECRET_FIELDS:
        if isinstance(out.get(section), dict) and out[section].get(name) is not None:
            out[section] = {**out[section], name: REDACTED}
    return out


def flat_values(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A dumped config as `a.b.c -> value`, values keeping their own types (lists of models by index)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_values(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                out.update(flat_values(v, f"{name}.{i}."))
        else:
            out[name] = value
    return out


def flatten(cfg: BaseModel | dict[str, Any]) -> dict[str, str]:
    """The config as `a.b.c -> value` strings, credentials redacted: MLflow params and config diffs."""
    data = cfg.model_dump() if isinstance(cfg, BaseModel) else cfg
    return {k: str(v) for k, v in flat_values(redacted(data)).items()}
