"""Which objective a study that edits code may decide on: a score its judges computed, never an agent's own number.

A study that edits code runs proposal code, which is an attacker until a person approved it. The numbers
it decides on must come from judges that code cannot reach (DESIGN §3.7, issue 38 item 5). The core logs
`reward/mean` and `reward/<sandbox>/mean` from judge scores when a batch holds judged episodes, but a
sandbox without a judge reports whatever reward its agent chose (the trainer's mean of it, or
`unjudged_reward/<sandbox>/mean` beside judged ones), and `agent_reward/*` is what judged agents said of
themselves. So a code study's objective is refused at brief load when it is:

- `agent_reward/...` or `unjudged_reward/...`: an agent's own number, whatever the sandbox;
- `reward/mean` or `eval/mean` while a client of the base config is not a judged sandbox (a module, or a
  sandbox folder whose sandbox.toml names no judge): its rewards would be averaged in, or be the mean;
- `reward/<sandbox>/...` or `eval/<sandbox>/...` of a sandbox no judge of the config's clients scores.

Other metrics (`train/loss`, ...) are not episode scores and pass. A study that edits no code runs the
person's own agents unchanged in every arm, so its objective is not checked here.

It reads the run config and sandbox folders only (`researcher.brief.judges`); it loads no judge.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from core.config import RunConfig
from researcher.brief.judges import TOML, judge_name

SANDBOXES = "sandboxes"  # where `sandbox:NAME` clients live, as the core's sandbox contract says
OWN_NUMBERS = ("agent_reward/", "unjudged_reward/")  # what an agent reported, never a judge's score
SCORED = ("reward/", "eval/")  # episode scores: a judge's only for judged sandboxes
MEANS = ("reward/mean", "eval/mean")  # over every episode of a step


def _folder(agent: str, cfg: RunConfig, workdir: Path) -> Path | None:
    """The sandbox folder a client runs, looked up as the core does (the config's project, then `workdir`)."""
    if agent.startswith("sandbox:"):
        name = agent.removeprefix("sandbox:")
        roots = [p / SANDBOXES for p in (cfg.source_file.parents if cfg.source_file else []) if (p / SANDBOXES).is_dir()][:1]
        for root in [*roots, workdir / SANDBOXES]:
            if (root / name / "agent.py").is_file():
                return root / name
        return None
    path = Path(agent) if Path(agent).is_absolute() else workdir / agent
    return path if path.is_dir() else None


def judged_clients(cfg: RunConfig, workdir: Path) -> tuple[set[str], list[str]]:
    """(names of the judged sandboxes the config's clients run, the clients that are not judged sandboxes)."""
    judged: set[str] = set()
    unjudged: list[str] = []
    for client in cfg.clients:
        folder = _folder(client.agent, cfg, workdir)
        if folder is not None and judge_name(folder) is not None:
            judged.add(folder.name)
            try:
                name = tomllib.loads((folder / TOML).read_text()).get("name")
            except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
                name = None
            if isinstance(name, str):
                judged.add(name)  # the name its metrics carry, when sandbox.toml gives one
        else:
            unjudged.append(client.agent)
    return judged, unjudged


def objective_problem(metric: str, cfg: RunConfig, workdir: Path) -> str | None:
    """Why a code study may not decide on `metric` with this base config, or None when it may."""
    if metric.startswith(OWN_NUMBERS):
        return (f"{metric} is what agents report of themselves, not a judge's score: a study that edits code "
                "decides only on scores its judges compute (reward/mean, reward/<sandbox>/mean, eval/<sandbox>/mean)")
    if not metric.startswith(SCORED):
        return None
    judged, unjudged = judged_clients(cfg, workdir)
    if metric in MEANS:
        if unjudged:
            return (f"{metric} would average in the rewards of {', '.join(unjudged)}, which no judge scores: a study "
                    "that edits code decides only on judged scores; give every client of the base config a judged "
                    "sandbox, or decide on reward/<sandbox>/mean of a judged one")
        return None
    sandbox = metric.split("/")[1]
    if sandbox not in judged:
        return (f"{metric}: sandbox {sandbox} is not a judged sandbox of the base config's clients "
                f"({', '.join(sorted(judged)) or 'none is judged'}), so its rewards are the agent's own number")
    return None
