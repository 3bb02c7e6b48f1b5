"""The agent side: the `SwarmClient` SDK, the client runner, loading a sandbox's agent code, episode deadlines, a client's failures and pid file.

It runs in a client process, which may live in another venv or machine. It may import `contain/`,
`episodes/` (the swarm routes' wire types), `sandbox/` (the folder format) and the foundation. It
never imports `serve/`: a client reaches a server over HTTP only.
"""
