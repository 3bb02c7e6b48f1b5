"""swarmrl's core: swarm servers that host trainable models behind an OpenAI-compatible API, and the clients that run agents against them.

Packages by job, importing one way only (tests/test_layering.py checks it), top to bottom:
    run/       one run from start to finish, and the `swarm` command
    ray/       optional Ray driver and actors; only `run.placement` imports it, and only when asked
    serve/     the HTTP side
    clients/   the agent side: SDK, runner, agent loading; never imports serve/
    contain/   containment of agent and proposal processes
    episodes/  the episode lifecycle on the server: registry, client table, credentials
    sandbox/   a sandbox's folder, judge and task dealer
    train/     the RL update
    engine/    generation
and the foundation every package may use: `config`, `config_io`, `models`, `records`, `local_state`,
`mlflow_history`.
"""
