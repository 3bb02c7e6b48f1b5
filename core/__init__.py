"""swarmrl's core: swarm servers that host trainable models behind an OpenAI-compatible API, and the clients that run agents against them.

Packages by job, importing one way only (tests/test_layering.py checks it), top to bottom:
    run/       one run from start to finish, and the `swarm` command
    ray/       optional Ray driver and actors; only `run.placement` imports it, and only when asked
    serve/     the HTTP side
    clients/   what runs agent code; never imports serve/
    episodes/  the episode lifecycle
    train/     the RL update
    engine/    generation
and the foundation every package may use: `config`, `config_io`, `models`, `records`, `auth`,
`mlflow_history`.
"""
