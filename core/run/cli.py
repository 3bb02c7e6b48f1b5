"""The `swarm` command: run, serve, attach clients, hot-swap them, inspect status, list models.

    swarm serve --model tiny --port 8000        # a quick server, the way `vllm serve MODEL` works
    swarm serve configs/tiny.yaml               # server and trainer from a run config
    swarm run configs/tiny.yaml                 # server, trainer and local clients, until the steps are done
    swarm status http://127.0.0.1:8000
    swarm contain --writable tree --timeout 60 -- python -c 'print(1)'   # one command, contained

Commands parse arguments and print; the work happens in `core.serve.server`, `core.run.processes` (run, serve), `core.clients.runner`,
`core.run.hotswap` and `core.run.contain_command`. Start-up stays light: torch and the server load only
inside the commands that need them.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import sys
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

from core.config import CONTAIN_MODES, ContainLimits, RunConfig
from core.config_io import ConfigError, load_config
from core.contain.contained import require_bwrap
from core.sandbox.folder import SandboxNotFound, locate, sandbox_roots
from core.local_state import local_admin_token
from core.run import warm
from core.run.contain_command import EXIT_TIMED_OUT, run_command

app = typer.Typer(help="swarmrl core: swarm servers and clients for agentic RL of LLMs.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(stderr=True)
# `swarm serve --model X --train` trains for as long as it serves (until stopped): a server that
# trains on whatever clients attach has no natural last step. A config file's trainer.steps, or
# `--set trainer.steps=N`, bounds it; after the last step it serves on and refuses train episodes.
SERVE_STEPS = 1_000_000_000
# Python's exit ends with a full garbage collection over every object the process still holds: for a
# `swarm run` (torch, transformers, MLflow) ~3 s of CPU after its work is done and its files are
# closed (bench/startup.py). Nothing left then needs collecting, so the last pass is skipped by
# freezing the heap; atexit handlers (logging, Ray, temporary folders) still run.
atexit.register(gc.freeze)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "openai", "urllib3", "alembic", "mlflow", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hidden network: models come from presets or local folders
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a down tracking server must not stall training


def _located(spec: str, roots: list[Path]) -> str:
    """A client spec as an absolute folder when it names one (`sandbox:NAME` looked up in `roots`); a
    missing sandbox is a one-line error naming where it looked, and exit code 2."""
    try:
        spec = locate(spec, roots)
    except SandboxNotFound as e:
        console.print(f"[red]{e}[/red]", soft_wrap=True)  # one line, however long the paths
        raise typer.Exit(2) from None
    return str(Path(spec).resolve()) if Path(spec).is_dir() else spec


def _config(path: Path | None, overrides: list[str]) -> RunConfig:
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None


@app.command()
def serve(
    config: Path = typer.Argument(None, help="run config YAML; optional when --model is given"),
    model: str = typer.Option(None, "--model", "-m", help="a preset (see `swarm models`) or a local HF folder"),
    name: str = typer.Option(None, help="name clients use for the model (default: --model)"),
    host: str = typer.Option(None, help="bind address (default 127.0.0.1)"),
    port: int = typer.Option(None, help="port (default 8000; 0 picks a free one)"),
    engine: str = typer.Option(None, help="hf | instant (the null engine, for benchmarks)"),
    train: bool = typer.Option(None, "--train/--no-train", help="run the trainer on finished groups (default: on with a config, off with --model alone)"),
    overrides: list[str] = typer.Option([], "--set", help="dotted.key=value config overrides"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Start a swarm server (and its trainer, with --train)."""
    _setup_logging(verbose)
    if config is None and model is None:
        console.print("[red]give a run config or --model[/red]")
        raise typer.Exit(2)
    extra = list(overrides)
    if model is not None:
        extra[:0] = [f"models=[{{name: {json.dumps(name or model)}, source: {json.dumps(model)}}}]"]
    if config is None and not any(o.startswith("trainer.steps=") for o in overrides):
        extra.append(f"trainer.steps={SERVE_STEPS}")
    for key, value in (("server.host", host), ("server.port", port), ("engine.kind", engine)):
        if value is not None:
            extra.append(f"{key}={value}")
    cfg = _config(config, extra)
    if cfg.placement.kind != "local":  # Ray actors are placed by `swarm run` (the driver); serve hosts here
        console.print("[red]placement.kind ray is for `swarm run`; `swarm serve` hosts its models in this process[/red]")
        raise typer.Exit(2)
    code = warm.delegate()  # with $SWARMRL_WARM: forked from a warm process, imports done (core.run.warm)
    if code is not None:
        raise typer.Exit(code)
    from core.run.processes import serve as serve_run

    raise typer.Exit(serve_run(cfg, train=train if train is not None else config is not None))  # 1: its run FAILED


@app.command()
def run(
    config: Path = typer.Argument(..., help="run config YAML"),
    overrides: list[str] = typer.Option([], "--set", help="dotted.key=value config overrides"),
    tags: list[str] = typer.Option([], "--tag", help="key=value MLflow tags for this run"),
    experiment: str = typer.Option(None, help="MLflow experiment (default: telemetry.experiment)"),
    run_name: str = typer.Option(None, help="MLflow run name"),
    run_id_file: Path = typer.Option(None, help="write the MLflow run id here as soon as it exists"),
    resume: bool = typer.Option(False, "--resume", help="continue from the latest checkpoint in trainer.checkpoint_dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no live progress line"),
    ray_address: str = typer.Option(None, "--ray-address", help="place models and clients as Ray actors: local (a "
                                    "private Ray), auto (the cluster this machine joined) or a cluster address"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate the config, print what would run where; start nothing"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """A whole manual core run: server, trainer and the configured clients, until the steps are done."""
    _setup_logging(verbose)
    extra = list(overrides)
    if ray_address:
        extra += ["placement.kind=ray", f"placement.address={json.dumps(ray_address)}"]
    if experiment:
        extra.append(f"telemetry.experiment={json.dumps(experiment)}")
    if run_name:
        extra.append(f"telemetry.run_name={json.dumps(run_name)}")
    bad = [t for t in tags if "=" not in t]
    if bad:
        console.print(f"[red]--tag {bad[0]!r} must look like key=value[/red]")
        raise typer.Exit(2)
    cfg = _config(config, extra)
    cfg.telemetry.tags.update(dict(t.split("=", 1) for t in tags))  # tag keys have dots: not overrides
    for c in cfg.clients:  # a missing sandbox stops the run here, before any model loads
        _located(c.agent, sandbox_roots(cfg.source_file))
    try:  # so does `required` containment on a machine without bubblewrap
        require_bwrap(cfg.containment.clients, "containment.clients")
    except ConfigError as e:
        console.print(f"[red]{e}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    if dry_run:
        from core.run.plan import describe

        try:
            print(describe(cfg))
        except ConfigError as e:
            console.print(f"[red]{e}[/red]")
            raise typer.Exit(2) from None
        raise typer.Exit(0)
    code = warm.delegate()
    if code is not None:
        raise typer.Exit(code)
    from core.run.processes import run as run_core

    code = run_core(cfg, resume=resume, run_id_file=run_id_file, progress=not quiet)
    raise typer.Exit(code)


@app.command(name="warm")
def warm_command(socket: Path = typer.Option(None, "--socket", help="the Unix socket to listen on, in a folder only "
                                             "you can enter (default: $XDG_RUNTIME_DIR/swarmrl/warm.sock)")):
    """Import what `swarm run` and `swarm serve` need once, then fork them from here: each with
    SWARMRL_WARM=SOCKET in its environment skips its imports (core.run.warm). Only this user's processes
    outside any sandbox may use it. Stops on SIGTERM or Ctrl-C."""
    socket = socket or warm.default_socket()
    _setup_logging(False)  # its environment defaults, as a cold start sets them before these imports
    logging.root.handlers.clear()  # a forked command configures its own logging
    before = dict(os.environ)
    try:
        warm.claim(socket)  # before the imports: a second warm process on one socket fails at once
        import core.run.processes  # noqa: F401  the imports every fork shares

        warm.WarmServer(socket, _forked, before).serve()
    except (OSError, RuntimeError) as e:
        console.print(f"[red]swarm warm: {e}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


def _forked(args: list[str]) -> int:
    """A `swarm` command in a child of `swarm warm`, run from the top as a cold start runs it."""
    global console
    console = Console(stderr=True)  # rich read the terminal and $COLUMNS of the warm process at import
    try:
        app(args=args, prog_name="swarm")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0


@app.command()
def client(
    sandbox: str = typer.Argument(..., help="a sandbox folder name under sandboxes/, a path, or module:function"),
    server: str = typer.Option(..., "--server", help="swarm server URL"),
    concurrency: int = typer.Option(4, help="episodes in flight"),
    episodes: int = typer.Option(0, help="stop after this many episodes (0: run until interrupted)"),
    group_size: int = typer.Option(None, help="episodes per task group (default: the server's)"),
    kind: str = typer.Option("train", help="train | eval | debug"),
    client_id: str = typer.Option(None, help="this client's id in the server's client table (default: sandbox-host-pid-random)"),
    max_consecutive_failures: int = typer.Option(  # 20: core.clients.runner.MAX_CONSECUTIVE_FAILURES (not imported: start-up time)
        20, min=0, help="give up (exit 2) after this many failed episodes in a row; 0: never"),
    workdir: Path = typer.Option(None, help="run in this working folder (created); `swarm run` gives each isolated client its own"),
    split: str = typer.Option("train", help="the split of the sandbox's tasks() to run"),
    tasks: int = typer.Option(None, help="stop after this many tasks (default: cycle until stopped)"),
    episode_timeout: float = typer.Option(  # None: core.clients.deadline.EPISODE_TIMEOUT_S (not imported: start-up time)
        None, min=0, help="cancel a rollout and abort its episode after this many seconds (default 600; 0: no limit)"),
    seed: str = typer.Option(None, help="draw the train split's tasks in an order shuffled by this seed (default: as yielded)"),
    code_version: str = typer.Option(None, "--code-version", help="the code version to report: the one its run or swap "
                                     "bound to its credential (default: the sandbox folder's git commit or file hash)"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Attach a client to a running server; SIGTERM drains (at most one lease), a second SIGTERM or SIGINT exits now."""
    _setup_logging(verbose)
    if workdir is not None:
        sandbox = _located(sandbox, sandbox_roots())  # sandbox:NAME or a relative folder: found before leaving
        workdir.mkdir(parents=True, exist_ok=True)
        sys.path.insert(0, os.getcwd())  # a module agent still imports from where the client was started
        os.chdir(workdir)
    from core.clients.runner import run_client

    sys.exit(run_client(sandbox, server, concurrency=concurrency, episodes=episodes, group_size=group_size, kind=kind,
                        max_consecutive_failures=max_consecutive_failures, client_id=client_id, split=split,
                        max_tasks=tasks, episode_timeout_s=episode_timeout, seed=seed, code_version=code_version))


@app.command()
def swap(
    sandbox: str = typer.Argument(..., help="the sandbox (new code) that takes over: sandbox:NAME or a folder"),
    server: str = typer.Option(..., "--server", help="swarm server URL, or a run's server.json (or its run folder)"),
    concurrency: int = typer.Option(None, help="episodes in flight for the new version (default: the old client's)"),
    admin_token: str = typer.Option(None, "--admin-token", help="the server's admin token (default: $SWARMRL_ADMIN_TOKEN, "
                                    "the server file, or this machine's record of the server)"),
    timeout: float = typer.Option(180.0, help="seconds the new client gets to register and finish its first episode "
                                  "(180: core.run.hotswap.REGISTER_TIMEOUT_S); past them it is stopped and the old one keeps serving"),
    ab: bool = typer.Option(False, "--ab", help="A/B: the old clients keep serving beside the new one (which gets their "
                            "summed concurrency: a 50/50 split); the swap is recorded, nobody drains"),
    drain_version: str = typer.Option(None, "--drain-version", help="end an A/B: drain SANDBOX's (a name or folder) "
                                      "clients of this version, a client of another version their successor"),
    contain: str = typer.Option("off", "--contain", help="off | auto | required: start the new client contained "
                                "(docs/security.md), as containment.clients does for a run's clients; required "
                                "refuses without bubblewrap"),
):
    """Hot-swap a sandbox's clients through the server: start the new code with the old one's kind and group size,
    wait until it has registered, then have the server drain the old clients (they may run anywhere)."""
    _setup_logging(False)
    from core.run.hotswap import drain_version as drain_clients, swap as swap_client

    if drain_version is not None:
        sys.exit(drain_clients(sandbox, server, drain_version, admin_token=admin_token))
    if contain not in CONTAIN_MODES:
        console.print(f"[red]swarm swap: --contain must be one of {', '.join(CONTAIN_MODES)}, not {contain!r}[/red]")
        sys.exit(2)
    sys.exit(swap_client(sandbox, server, concurrency=concurrency, admin_token=admin_token, register_timeout_s=timeout,
                         ab=ab, contain=contain))


@app.command(context_settings={"allow_interspersed_args": False})
def contain(
    argv: list[str] = typer.Argument(..., help="the command to run (after `--`)"),
    writable: list[Path] = typer.Option([], "--writable", help="a folder it may write under bwrap (repeat); "
                                        "everything else is read-only"),
    cwd: Path = typer.Option(None, "--cwd", help="its working folder (default: this one)"),
    env: list[str] = typer.Option([], "--env", help="K=V added to its allowlisted environment (repeat); a "
                                  "credential's name is refused"),
    timeout: float = typer.Option(0, "--timeout", min=0, help="kill its whole process group after this many "
                                  f"seconds and exit {EXIT_TIMED_OUT}; 0: no limit"),
    required: bool = typer.Option(False, "--required", help="refuse (exit 2) when bwrap is missing, instead of "
                                  "running without the filesystem boundary"),
    cpu_s: int = typer.Option(None, "--cpu-s", help=f"CPU seconds (default {ContainLimits().cpu_s}; 0: no limit)"),
    address_space: int = typer.Option(None, "--address-space", help="bytes of virtual memory "
                                      f"(default {ContainLimits().address_space})"),
    file_size: int = typer.Option(None, "--file-size", help=f"largest file, bytes (default {ContainLimits().file_size})"),
    processes: int = typer.Option(None, "--processes", help="processes beyond the user's "
                                  f"(default {ContainLimits().processes})"),
    open_files: int = typer.Option(None, "--open-files", help=f"open files (default {ContainLimits().open_files})"),
    memory: int = typer.Option(None, "--memory", help="bytes of memory of all its processes together, where a memory "
                               f"cgroup can be made (default {ContainLimits().memory})"),
    server: str = typer.Option(None, "--server", help="the swarm server URL it may reach (its episode routes only, "
                               "through a forwarder); without it, under bwrap, it has no network at all"),
    hide: list[Path] = typer.Option([], "--hide", help="a file or folder it must not read (repeat): masked under "
                                    "bwrap, besides every run's admin token and server files"),
):
    """Run one command contained (docs/security.md): no credential in its environment, resource limits, its own
    process group, bubblewrap when installed (then its own network namespace: no network but --server's episode
    routes). Exits with its exit code (128+N when killed by signal N)."""
    _setup_logging(False)
    given = {"cpu_s": cpu_s, "address_space": address_space, "file_size": file_size, "processes": processes,
             "open_files": open_files, "memory": memory}
    raise typer.Exit(run_command(argv, writable=writable, cwd=cwd, env=env, timeout=timeout, required=required,
                                 limits=given, server=server, hide=hide))


@app.command()
def status(url: str = typer.Argument("http://127.0.0.1:8000", help="swarm server URL"), as_json: bool = typer.Option(False, "--json")):
    """Show a server's state, models, buffer, episodes and throughput."""
    try:
        # A person's view: this machine's index holds the server's admin token when it runs here, and other
        # clients' ids and versions are shown to the admin token only (`core.episodes.credentials`).
        token = os.environ.get("SWARMRL_ADMIN_TOKEN") or local_admin_token(url) or ""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        data = httpx.get(url.rstrip("/") + "/swarm/v1/status", headers=headers, timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        console.print(f"[red]cannot reach {url}: {e}[/red]")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(data, indent=2))
        return
    table = Table(title=f"{url} — {data['state']}")
    table.add_column("model")
    table.add_column("version", justify="right")
    table.add_column("step", justify="right")
    for n, m in data["models"].items():
        table.add_row(n, str(m["version"]), str(m["step"]))
    Console().print(table)
    t = data["throughput"]
    Console().print(
        f"open episodes {data['open_episodes']}  ready groups {data['buffer']['ready_groups']}  "
        f"episodes {data['episodes']}\ncalls {t['calls']} ({t['calls_per_s']:.1f}/s)  tokens/s {t['tokens_per_s']:.1f}  "
        f"token-in-token-out {t['tito']}"
    )
    for n, m in data["models"].items():  # a model on replicas: each one's health, version and load
        for r in m.get("replicas", []):
            Console().print(f"{n} replica {r['replica']} on {r['device']} (pid {r['pid']}): "
                            f"{'up' if r['healthy'] else '[red]down[/red]'}, version {r['version']}, "
                            f"{r['episodes']} open episodes, {r['inflight']} calls in flight, {r['restarts']} restarts")
    for c in data.get("clients", []):  # registered client processes (hot swap drains through this table)
        Console().print(f"client {c['client_id']}: {c['sandbox']} @ {c['version'] or '-'} ({c['kind']}, group "
                        f"{c['group_size']}, pid {c['pid']} on {c['host']}) {c['state']}")
    if data.get("stalled"):  # the hang watchdog's diagnostic (core.run.watchdog)
        Console().print(f"[red]{data['stalled']}[/red]")


@app.command()
def models():
    """List the model presets; any local Hugging Face folder works too."""
    from core.models import PRESETS, cache_dir

    table = Table(title="model presets")
    table.add_column("name")
    table.add_column("what it is")
    for p in PRESETS.values():
        table.add_row(p.name, p.description)
    Console().print(table)
    Console().print(f"any local HF folder is accepted as a source; converted presets are cached under {cache_dir()}")


if __name__ == "__main__":
    app()
