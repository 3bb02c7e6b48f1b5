"""Core runs as the researcher sees them: started, found and stopped through `swarm` commands and HTTP.

launcher: local `swarm run` processes · ray_jobs: the same as Ray jobs · backends: the choice
between the two · live_swaps: one live run and the code swapped into it · live_watch: watching a
run's metrics for stalls and collapse. It never imports core internals (only `core.config`).
Imports: code, evidence and the foundation.
"""
