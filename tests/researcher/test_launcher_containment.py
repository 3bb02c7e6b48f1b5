"""The researcher's launcher turns client containment on for runs of a proposal's code (a launch with a
commit) and leaves a base-config launch as the person configured it; the switch it passes is one the core's
config schema accepts. It is `required` (bubblewrap or refuse) unless the brief sets `containment: auto`,
and then, without bubblewrap, the downgrade is said with what it loses. Reads the real argv the launcher builds."""

from __future__ import annotations

import logging
from pathlib import Path

from core.config_io import load_config
from researcher.records import Launch
from researcher.runs import launcher as launcher_module
from researcher.runs.launcher import Launcher, LaunchTarget, contain_mode

ROOT = Path(__file__).resolve().parents[2]
SWITCH = "containment.clients="


def _argv(tmp_path: Path, commit: str, containment: str = "required") -> list[str]:
    target = LaunchTarget(command=["swarm", "run"], workdir=ROOT, tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
                          experiment="e", study="s", containment=containment)  # type: ignore[arg-type]
    launcher = Launcher(target, tmp_path / "state", grace_s=1, emit=lambda *a, **k: None)
    launch = Launch(key="p1-s0", proposal_id="p1", seed=0, steps=2, commit=commit,
                    config_path=str(ROOT / "configs" / "tiny.yaml"))
    return launcher.argv(launch)


def _overrides(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_a_launch_of_proposal_code_contains_its_clients(tmp_path):
    switches = [o for o in _overrides(_argv(tmp_path, "abc123")) if o.startswith(SWITCH)]
    assert switches == [SWITCH + "required"]  # bubblewrap or no run, whatever this machine has
    cfg = load_config(ROOT / "configs" / "tiny.yaml", switches)  # the core's schema takes the switch
    assert cfg.containment.clients == "required"


def test_without_bubblewrap_only_a_brief_that_says_auto_downgrades_and_the_warning_says_what_is_lost(
        tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    monkeypatch.setattr(launcher_module, "_warned_auto", False)
    assert contain_mode("required") == "required" and not caplog.records
    assert [o for o in _overrides(_argv(tmp_path, "abc123")) if o.startswith(SWITCH)] == [SWITCH + "required"]
    with caplog.at_level(logging.WARNING, logger="researcher.runs.launcher"):
        switches = [o for o in _overrides(_argv(tmp_path, "abc123", "auto")) if o.startswith(SWITCH)]
    assert switches == [SWITCH + "auto"]
    (warning,) = [r.getMessage() for r in caplog.records]
    for lost in ("pid namespace", "/proc/<pid>/environ", "as root", "process limit", "apt-get install bubblewrap"):
        assert lost in warning, (lost, warning)


def test_a_base_config_launch_is_left_as_configured(tmp_path):
    assert not [o for o in _overrides(_argv(tmp_path, "")) if o.startswith(SWITCH)]
