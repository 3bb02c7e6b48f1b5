"""The researcher: an automated research agent around the core, grouped by job.

Top to bottom (tests/test_layering.py checks it):
    cli > study > review, runs, planner > code, evidence > foundation
The foundation is `records` (what a study remembers), `brief` (the brief's schema and loader),
`budget` (what has been spent) and `lazy`. A package imports its own modules, the packages below it
and the foundation; peers do not import each other. The researcher reaches the core only through
`swarm` commands, HTTP, MLflow and `core.config` / `core.config_io` / `core.mlflow_history`.
"""
