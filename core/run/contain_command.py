"""`swarm contain`'s work: one command run contained from the command line, and its exit code passed on.

`core.run.cli.contain` declares the options and hands them here. This checks them (a malformed `--env`,
a `--server` that is not an http(s) URL, a limit out of range, `--required` without bubblewrap: one line
naming the option, exit 2), warns when bubblewrap is missing, turns SIGTERM, SIGINT and SIGHUP into an
exit that kills the command's process group, runs it, and says how it ended as an exit code: its own,
128+N when killed by signal N, `EXIT_TIMED_OUT` past `--timeout`, 127 when it cannot start. It declares
no option and contains nothing itself: the boundary is `core.contain.contained.run_contained`'s.
"""

from __future__ import annotations

import signal
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from core.config import ContainLimits
from core.config_io import ConfigError
from core.contain.contained import bwrap, require_bwrap, run_contained

# The exit code when the command ran past --timeout (and its process group was killed): the code of
# coreutils' `timeout`, which scripts already read that way.
EXIT_TIMED_OUT = 124
# Its own, not the `swarm` app's: `swarm contain` is never forked from `swarm warm` (only run and serve are),
# so the terminal it reads at import is the one it runs in.
console = Console(stderr=True)


def run_command(argv: list[str], *, writable: list[Path], cwd: Path | None, env: list[str], timeout: float,
                required: bool, limits: dict[str, int | None], server: str | None, hide: list[Path]) -> int:
    """Run `argv` contained -> the exit code `swarm contain` ends with. `limits`: the `ContainLimits` fields
    given on the command line (None: its default); `env`: K=V pairs; `timeout` 0: no limit."""
    bad = [e for e in env if "=" not in e or not e.split("=", 1)[0]]
    try:
        if bad:
            raise ConfigError(f"--env {bad[0]!r} must look like KEY=value")
        if server is not None and not server.startswith(("http://", "https://")):
            raise ConfigError(f"--server {server!r} must be an http(s) URL of a swarm server")
        require_bwrap("required" if required else "auto", "swarm contain --required")
        checked = ContainLimits(**{k: v for k, v in limits.items() if v is not None})
    except ValidationError as e:  # a limit out of range: one line naming the option
        why = "; ".join(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}" for err in e.errors())
        console.print(f"[red]swarm contain: {escape(why)}[/red]", soft_wrap=True)
        return 2
    except ConfigError as e:
        console.print(f"[red]swarm contain: {escape(str(e))}[/red]", soft_wrap=True)
        return 2
    if bwrap() is None:
        console.print("[yellow]swarm contain: bwrap is not on PATH: running without the filesystem boundary "
                      "(apt-get install bubblewrap)[/yellow]", soft_wrap=True)

    def stopped(sig: int, _frame: object) -> None:  # run_contained then kills the command's group on its way out
        raise SystemExit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stopped)
    try:  # every run's token and server files are masked by run_contained itself (contain.masked_paths)
        code, _ = run_contained(argv, cwd or Path.cwd(), timeout_s=timeout or None, writable=writable,
                                extra_env=dict(e.split("=", 1) for e in env), limits=checked, capture=False,
                                hidden=hide, server=server)
    except ValueError as e:  # a credential passed with --env (its name is the caller's data: never markup)
        console.print(f"[red]swarm contain: {escape(str(e))}[/red]", soft_wrap=True)
        return 2
    except OSError as e:
        console.print(f"[red]swarm contain: cannot start {escape(argv[0])}: {escape(str(e))}[/red]", soft_wrap=True)
        return 127
    if code is None:
        console.print(f"swarm contain: timed out after {timeout:g} s; its process group was killed", soft_wrap=True)
        return EXIT_TIMED_OUT
    return code if code >= 0 else 128 - code
