"""The HTTP side of a swarm server: the server object, the gateway's OpenAI-compatible and swarm routes, streaming, chat rendering and the OpenAI wire types.

It may import clients/ (the client table), episodes/, train/, engine/ and the foundation. It must not
import run/ or ray/, and nothing in clients/, episodes/, train/ or engine/ may import it.
"""
