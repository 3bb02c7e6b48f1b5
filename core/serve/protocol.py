"""The episode protocol on the gateway: what an agent may not decide for itself about its own calls.

A judged sandbox's `sandbox.toml` declares its episode protocol (`core.sandbox.folder.EpisodeProtocol`,
carried by its judge), and every API's call passes through here before it reaches an engine:

- **seed**: in train and eval episodes a request's own `seed` is refused (400 `seed_not_allowed`): the
  server's sampler (seeded by `trainer.seed`, per call under `engine.repeatable_sampling`) decides what
  is drawn, so an agent cannot search seeds for a lucky draw. Debug episodes and anonymous requests keep it.
- **eval sampling**: an eval episode's calls sample as `[eval_sampling]` says (temperature, top_p,
  max_tokens, stop), whatever the request asks, so every arm of a study is scored the same way.
- **max_calls**: a train or eval episode may start at most `max_calls` model calls, each choice of a
  request counting as one and a call counting once started (one cut off mid-stream, or failed, too). The
  call beyond is refused (400 `max_calls_exceeded`, naming the limit) before anything is generated, and
  the episode ends there: its judge's failure value is its score. An agent that samples until it likes
  a reply therefore only loses.

Deliberately not here: reading or validating sandbox.toml (`core.sandbox.folder`), what a judge scores
(`core.sandbox.judge`), and sampling itself (`core.serve.gateway.sampling`, the engines). Unjudged
sandboxes have no protocol on the server: only the seed rule applies to their episodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.episodes.errors import Refusal
from core.records import Episode
from core.sandbox.folder import EpisodeProtocol
from core.serve.state import ServerState

BOUND_KINDS = ("train", "eval")  # the episodes that count somewhere: the protocol binds them; debug ones are free


@dataclass(frozen=True)
class CallSampling:
    """The sampling one call gets: the request's own, or an eval episode's fixed setting."""

    temperature: float | None  # None: the server's engine.default_temperature
    top_p: float
    max_tokens: int | None  # None: the server's engine.default_max_tokens
    stop: tuple[str, ...]


def protocol_of(server: ServerState, episode: Episode | None) -> EpisodeProtocol | None:
    """The protocol of an episode's sandbox (None: anonymous, or a sandbox this server does not judge)."""
    judge = server.judges.get(episode.sandbox) if episode is not None else None
    return judge.protocol if judge is not None else None


def call_sampling(server: ServerState, episode: Episode | None, body, requested: int | None) -> CallSampling:
    """The sampling of a call `body` asks for in `episode` (`requested`: its max_tokens, whichever field
    carried it), after the protocol: a seed refused in train and eval episodes, an eval episode's fixed."""
    if episode is not None and episode.kind in BOUND_KINDS and body.seed is not None:
        raise Refusal(400, f"seed is not allowed in a {episode.kind} episode: the server's seeds decide what is "
                      "sampled (only debug episodes may name one)", "seed_not_allowed", param="seed")
    protocol = protocol_of(server, episode)
    if episode is None or episode.kind != "eval" or protocol is None or protocol.eval_sampling is None:
        return CallSampling(body.temperature, body.top_p, requested, tuple(body.stop or ()))
    fixed = protocol.eval_sampling  # the sandbox's, whatever the request says
    return CallSampling(fixed.temperature, fixed.top_p, fixed.max_tokens, tuple(fixed.stop))


def start_calls(server: ServerState, episode: Episode | None, n: int) -> None:
    """Count `n` calls (a request's choices) as started in `episode`, or refuse them beyond its
    sandbox's `max_calls` and end the episode with its judge's failure value. Called last before
    generating, after every other check: a request refused for a bad field costs no call."""
    if episode is None or episode.kind not in BOUND_KINDS:
        return
    protocol = protocol_of(server, episode)
    limit = protocol.max_calls if protocol is not None else None
    if limit is not None and episode.calls_started + n > limit:
        asked = f"{n} more calls" if n > 1 else "another call"
        reason = (f"{asked} after {episode.calls_started} would exceed sandbox.toml max_calls = {limit} of sandbox "
                  f"{episode.sandbox!r}")
        try:
            server.registry.abort(episode.id, reason)  # a judged episode is finished with its failure value
        except Refusal:
            pass  # it ended meanwhile (a late call): it scores what it scored
        raise Refusal(400, f"{reason}: the episode has ended and scores its judge's failure value",
                      "max_calls_exceeded", param="n" if n > 1 else None)
    episode.calls_started += n
