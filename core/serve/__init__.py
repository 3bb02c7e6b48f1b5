"""The HTTP side of a swarm server: the server object, the gateway's OpenAI-compatible and swarm routes, streaming, chat rendering and the OpenAI wire types.

It may import episodes/ (the registry, the client table, credentials), sandbox/ (judges, the dealer),
train/, engine/ and the foundation. It must not import clients/ (the agent side runs in another
process: tests/test_structure.py), run/ or ray/, and no package below it may import it.
"""
