"""One run from start to finish: the loop, the `swarm` command and its `run`/`serve` processes, checkpoints, MLflow telemetry, watchdog, supervisor and placement; and the operator's commands on a running server (`swarm swap`, server files, the `swarm client` command line).

The top of the core: it may import every other package. Nothing below imports it, except `core.ray`,
which builds its run on `core.run.loop` and reads `core.run.plan` and `core.run.checkpoint`.
"""
