"""Optional Ray placement: the driver and the actors (one per model, engine and trainer together; one per client).

Imports `ray` at module level, so only `core.run.placement` imports this package, inside the function
that a Ray placement calls: a local run never loads Ray. It may import serve/ and everything below,
and of run/ only `loop`, `plan` and `checkpoint`: placement, the processes and the command stand above it.
"""
