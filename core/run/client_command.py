"""The `swarm client` command line, built in one place: a `ClientSpec` and its `to_argv()`.

The run starts its isolated clients with it (`core.run.loop`), and `swarm swap` its new client
(`core.run.hotswap`); each option is spelled here once, as `core.run.cli.client` declares it
(tests/core/test_client_command.py parses what `to_argv` builds with that very command). It is
deliberately not the command (`core.run.cli`), nor how the process is started, contained or
supervised (`core.run.supervisor`, `core.contain.contained`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The module `python -m` runs for `swarm client`: the command itself, not the `swarm` script, so the
# client runs under the interpreter given (a sandbox's own venv) without that venv needing the script.
CLI_MODULE = "core.run.cli"


@dataclass(frozen=True)
class ClientSpec:
    """One client process: its sandbox, the server it serves, and the `swarm client` options it is given;
    an option left None is not passed, so the command's default holds."""

    python: str  # the interpreter it runs under (a sandbox's venv, `core.contain.venvs`)
    sandbox: str  # a sandbox folder, `sandbox:NAME` or `module:function`
    server: str  # the server's URL
    concurrency: int | None = None
    group_size: int | None = None
    kind: str | None = None  # train | eval | debug
    client_id: str | None = None  # its id in the server's client table
    workdir: Path | None = None  # the working folder it runs in (created)
    split: str | None = None
    tasks: int | None = None  # stop after this many tasks
    episode_timeout: float | None = None  # seconds
    seed: str | None = None  # the train split's task order
    # The code version its launcher bound to its credential: a contained client cannot read its folder's git,
    # so it would name its code by a hash of the files instead, and the server would refuse every open.
    code_version: str | None = None

    def to_argv(self) -> list[str]:
        """The command line that starts it."""
        argv = [self.python, "-m", CLI_MODULE, "client", self.sandbox, "--server", self.server]
        for option, value in (("--concurrency", self.concurrency), ("--group-size", self.group_size),
                              ("--kind", self.kind), ("--client-id", self.client_id), ("--workdir", self.workdir),
                              ("--split", self.split), ("--tasks", self.tasks),
                              ("--episode-timeout", self.episode_timeout), ("--seed", self.seed),
                              ("--code-version", self.code_version)):
            if value is not None:
                argv += [option, str(value)]
        return argv
