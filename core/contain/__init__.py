"""Containment of the processes that run agent or proposal code: bubblewrap, the network forwarder and relay, process limits, and a sandbox's own venv.

It may import `sandbox/` (a sandbox's requirements), the packages below it and the foundation, never
`clients/`, `serve/`, `run/` or `ray/`: it starts and bounds a process, and knows nothing of what the
process runs or of the server it talks to beyond an address.
"""
