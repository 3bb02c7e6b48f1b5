"""The episode lifecycle on the server: the episode open (`opener`), the registry (leases, states, groups, batch
assembly) with its keys, books and admission, mix quotas, the client table, client credentials, the one
failure type (`errors.Refusal`) and the swarm routes' wire types.

It may import `sandbox/` (the dealer and judge), `train/`, `engine/` and the foundation, and never
`serve/`, `clients/`, `contain/`, `run/` or `ray/`: the registry knows episodes, not HTTP or the
processes that open them.
"""
