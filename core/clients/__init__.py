"""What runs agent code: the `SwarmClient` SDK, client runners, sandboxes and their venvs, deadlines, hot swap of client code, the server's client table, and containment of the processes that run agent code.

It may import episodes/ (the swarm routes' wire types) and the foundation. It never imports serve/:
a client reaches a server over HTTP only, so it can run in another process, venv or machine.
"""
