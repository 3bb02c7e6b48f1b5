"""The server's side of a sandbox: its folder and `sandbox.toml`, its judge, and the dealer of a judged sandbox's tasks.

It may import the packages below it (`train/`, `engine/`) and the foundation, never `episodes/`,
`contain/`, `clients/`, `serve/`, `run/` or `ray/`: it reads sandbox folders and scores records; it
runs no agent code (that is `clients/`).
"""
