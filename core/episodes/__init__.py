"""The episode lifecycle on the server: the registry (keys, leases, states, groups, batch assembly), admission, mix quotas, the client table, credentials and the swarm routes' wire types.

It may import `sandbox/` (the dealer and judge), `train/`, `engine/` and the foundation, and never
`serve/`, `clients/`, `contain/`, `run/` or `ray/`: the registry knows episodes, not HTTP or the
processes that open them.
"""
