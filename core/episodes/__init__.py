"""The episode lifecycle: the registry (keys, leases, states, groups, batch assembly), admission, mix quotas and the swarm routes' wire types.

It may import train/, engine/ and the foundation, and never serve/, clients/, run/ or ray/: the
registry knows episodes, not HTTP or the processes that open them.
"""
