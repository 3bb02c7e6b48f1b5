"""Shared helpers for the researcher tests: briefs written to a temporary project folder."""

from __future__ import annotations

from pathlib import Path

from researcher.brief import Brief, parse_brief

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


def make_brief(workdir: Path, space: str, extra: str = "", **kw: str) -> Brief:
    (workdir / "base.yaml").write_text(BASE_CONFIG)
    return parse_brief(brief_text(space, extra, **kw), workdir=workdir)
