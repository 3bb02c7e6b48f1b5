"""Streamed chat turns: the engine's tokens as typed events, and the Chat Completions SSE made of them.

`chat_events` runs one prepared chat turn and yields `TextDelta`, `ChoiceDone` and `ChoiceFailed`
events; every streamed API (Chat Completions here, Responses in `core.serve.responses`, Messages in
`core.serve.messages`) formats those same events, so they stream and record alike. Text streams token
by token as the engine samples it, held back only where a stop string might still be forming or a
UTF-8 character is incomplete. When tools are offered, the reply comes whole at the end, because a
tool call is only known once its closing tag has arrived. Recording happens exactly as for
non-streamed calls, once a choice is complete. Each choice's engine await is bounded by
`server.request_timeout_s`; a choice that fails or times out is an in-stream event.

The bookkeeping per token is O(1) in the completion's length: only the new text, the unsent tail
(at most the longest stop string) and a window since the last stable decode point are touched.
This module does not render, parse requests or import the gateway (it gets it as a parameter).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from core.engine import Generation, SamplingParams
from core.engine.detokenize import IncrementalText
from core.episodes.errors import Refusal
from core.records import Episode
from core.serve.chat import Rendered
from core.serve.state import Policy


@dataclass
class PreparedChat:
    """One chat turn, rendered and ready to generate: what every API's route hands the engine."""

    policy: Policy
    messages: list[dict]  # the template's messages, recorded on the call
    tools_offered: bool  # tool calls are parsed out of the reply
    rendered: Rendered
    params: list[SamplingParams]  # one per choice
    stop: list[str]  # the client's stop strings (the reply is cut before them)
    forced: str = ""  # the reply's start, in the prompt already (`tool_choice`: the template's call text)
    one_call: bool = False  # generation stops after the first call (`parallel_tool_calls: false`)
    capped_from: int | None = None  # the max_tokens asked, when it was cut to fit the context (Messages)

    def reply(self, gen: Generation) -> dict:
        """The assistant message of one choice: its text cut at the stop string that ended it (kept when
        it was the server's own call close), after the forced start, tool calls parsed."""
        text = self.policy.renderer.completion_text(gen.token_ids)
        if gen.stop_string and gen.stop_string in text:
            end = text.index(gen.stop_string)
            if gen.stop_string not in self.stop:  # the server's stop (`one_call`): part of the call, kept
                end += len(gen.stop_string)
            text = text[:end]
        return self.policy.renderer.parse_reply(self.forced + text, self.tools_offered)

    def stopped_by_client(self, gen: Generation) -> str | None:
        """The client's stop string that ended this choice, if one did."""
        return gen.stop_string if gen.stop_string in self.stop else None


@dataclass
class TextDelta:
    index: int  # the choice
    text: str


@dataclass
class ChoiceDone:
    index: int
    reply: dict  # the assistant message, tool calls parsed
    gen: Generation


@dataclass
class ChoiceFailed:
    index: int
    message: str
    type: str  # OpenAI error type
    code: str | None


class _Held:
    """What of one choice's text is sent, and what is held back in case a stop string is forming.

    Nothing is sent that could belong to a stop string: before sending, the whole unsent text (and
    the sent tail a stop string could begin in) is searched, so a stop string that starts in the
    part about to go out and ends in the part held back blocks it. Once blocked, the rest of the
    reply comes from the recorded text (`chat_events`), cut where the engine cut it.
    """

    def __init__(self, hold: int, tail: int):
        self.hold, self.tail_len = hold, tail
        self.pending = ""  # stable text not sent yet: at most `hold` chars plus the last token's
        self.tail = ""  # the last `tail_len` chars sent: a stop string overlapping new text starts there
        self.sent: list[str] = []
        self.blocked = False  # a stop string showed up: the engine stops soon, the final text is cut

    def take(self, piece: str, stops: list[str]) -> str:
        """Add newly stable text; returns what may be sent now."""
        if self.blocked or not piece:
            return ""
        self.pending += piece
        window = self.tail + self.pending
        if any(s in window for s in stops):
            self.blocked = True
            return ""
        if len(self.pending) <= self.hold:
            return ""
        out = self.pending[: len(self.pending) - self.hold]
        self.pending = self.pending[len(out) :]
        sent = self.tail + out
        self.tail = sent[-self.tail_len :] if self.tail_len else ""
        self.sent.append(out)
        return out


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: a JSON object, or a bare string such as `[DONE]`; `event:` named if given."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def chat_events(gw, prep: PreparedChat, episode: Episode | None
                      ) -> AsyncIterator[TextDelta | ChoiceDone | ChoiceFailed]:
    """The events of one streamed chat turn. `gw` is the gateway that renders and records (`text_of`,
    `make_call`, `record`): passed in, so this module never imports the gateway. Closing the iterator
    (a client that went away) cancels every choice's generation."""
    policy, n = prep.policy, len(prep.params)
    longest_stop = max((len(s) for s in prep.stop), default=0)
    held = [_Held(max(longest_stop - 1, 0), max(longest_stop - 1, 0)) for _ in range(n)]
    texts = [IncrementalText(policy.renderer.completion_text) for _ in range(n)]
    events: asyncio.Queue = asyncio.Queue()
    timeout = gw.server.cfg.server.request_timeout_s

    async def run(i: int):
        try:
            gen = await asyncio.wait_for(policy.engine.generate(
                prep.rendered.prompt_ids, prep.params[i], on_token=lambda t: events.put_nowait((i, t))), timeout)
            events.put_nowait((i, gen))
        except TimeoutError:
            events.put_nowait((i, TimeoutError(f"no answer within server.request_timeout_s ({timeout:g} s)")))
        except Exception as e:  # reported in-stream: the HTTP status is already sent
            events.put_nowait((i, e))

    tasks = [asyncio.create_task(run(i)) for i in range(n)]
    try:
        done = 0
        while done < n:
            i, item = await events.get()
            if isinstance(item, int):
                if not prep.tools_offered and not held[i].blocked:
                    out = held[i].take(texts[i].add(item), prep.stop)
                    if out:
                        yield TextDelta(i, out)
                continue
            done += 1
            if isinstance(item, Exception):
                yield ChoiceFailed(i, f"generation failed: {item}", "server_error", None)
                continue
            reply = prep.reply(item)
            try:
                gw.record(episode, gw.make_call(policy, prep.messages, prep.rendered, item, reply))
            except Refusal as e:  # the lease ran out while generating
                yield ChoiceFailed(i, str(e), "conflict_error", e.code)
                continue
            sent = "".join(held[i].sent)
            final_text = reply.get("content") or ""
            if final_text.startswith(sent) and len(final_text) > len(sent):
                yield TextDelta(i, final_text[len(sent) :])
            yield ChoiceDone(i, reply, item)
    finally:
        for t in tasks:
            t.cancel()


async def stream_chat(gw, prep: PreparedChat, include_usage: bool, episode: Episode | None) -> AsyncIterator[bytes]:
    """The SSE body of one streamed chat completion, made of `chat_events`."""
    chunk_id, created, name = "chatcmpl-" + uuid.uuid4().hex, int(time.time()), prep.policy.name

    def chunk(index: int, delta: dict, finish: str | None = None) -> bytes:
        return sse({"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    for i in range(len(prep.params)):
        yield chunk(i, {"role": "assistant", "content": ""})
    completion_tokens = 0
    events = chat_events(gw, prep, episode)
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield chunk(ev.index, {"content": ev.text})
            elif isinstance(ev, ChoiceFailed):
                yield sse({"error": {"message": ev.message, "type": ev.type, "code": ev.code}})
            else:
                completion_tokens += len(ev.gen.token_ids)
                calls = ev.reply.get("tool_calls")
                if calls:
                    yield chunk(ev.index, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                yield chunk(ev.index, {}, "tool_calls" if calls else ev.gen.finish_reason)
    finally:
        await events.aclose()
    if include_usage:
        prompt = len(prep.rendered.prompt_ids)
        yield sse({"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": name,
                   "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                                            "total_tokens": prompt + completion_tokens}})
    yield sse("[DONE]")
