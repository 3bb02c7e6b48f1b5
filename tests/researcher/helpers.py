"""Shared helpers for the researcher tests: briefs written to a temporary project folder."""

from __future__ import annotations

from pathlib import Path

from researcher.brief.loader import parse_brief
from researcher.brief.schema import Brief

BASE_CONFIG = "trainer:\n  steps: 8\n  lr: 1.0e-5\n"


def brief_text(space: str, extra: str = "", objective: str = "reward/mean", direction: str = "maximize",
               base: str = "base.yaml") -> str:
    return f"""---
title: test study
objective:
  metric: {objective}
  direction: {direction}
run:
  base_config: {base}
search_space:
{space}
{extra}
---
Test brief.
"""


# The smallest judge a code study's sandbox needs (DESIGN §3.7): the brief refuses editable sandboxes without one.
JUDGE = "FAILURE = 0.0\n\ndef tasks(split):\n    yield {'id': split}\n\ndef score(task, episode):\n    return 0.0\n"


def judged_sandbox(folder: Path) -> Path:
    """Make `folder` a judged sandbox (sandbox.toml naming judge.py), keeping any files it has."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sandbox.toml").write_text(f'name = "{folder.name}"\njudge = "judge.py"\n')
    (folder / "judge.py").write_text(JUDGE)
    return folder


def make_brief(workdir: Path, space: str, extra: str = "", **kw: str) -> Brief:
    (workdir / "base.yaml").write_text(BASE_CONFIG)
    return parse_brief(brief_text(space, extra, **kw), workdir=workdir)


def wait_until_up(url: str, what: str, timeout_s: float, proc=None, log=None) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits (showing the tail of `log`)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what} exited:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise AssertionError(f"{what} did not come up")
