"""`POST /v1/messages`: the Anthropic Messages API over the one chat path.

A request is converted to the internal chat request (`core.serve.messages_wire.to_chat`), run by the
gateway's chat path (the same rendering, token-in-token-out, tool-call parsing and `records.Call` as
Chat Completions), and its reply converted back: a `text` block, then one `tool_use` block per tool
call, with `stop_reason` `tool_use`, `max_tokens`, `stop_sequence` (naming it) or `end_turn`.
Streaming formats the chat path's events (`core.serve.streaming.chat_events`) as the Messages events
(`message_start`, `content_block_start`/`_delta`/`_stop`, `message_delta`, `message_stop`), each
named on its `event:` line as the anthropic SDK reads them; a failure is an `error` event.
`count_tokens` renders a request as `create` does and counts it. A `max_tokens` past the context is
cut to fit, and the response says so in `CAPPED_HEADER`.
This module does not render, generate or record; the gateway does.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from core.engine import Generation
from core.records import Episode
from core.serve.messages_wire import CountTokensRequest, MessagesRequest, to_chat
from core.serve.streaming import ChoiceFailed, PreparedChat, TextDelta, chat_events, sse


# The response header that says a `max_tokens` past the context was cut to fit: a Messages client must
# always send one (ChatAnthropic sends 4096), so it is capped rather than refused; the value is the
# number of tokens the reply could take.
CAPPED_HEADER = "x-swarmrl-max-tokens-capped"


def stop_reason(prep: PreparedChat, reply: dict[str, Any], gen: Generation) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a reply, in Anthropic's terms (only the client's stop sequences named)."""
    if reply.get("tool_calls"):
        return "tool_use", None
    if gen.finish_reason == "length":
        return "max_tokens", None
    if prep.stopped_by_client(gen):
        return "stop_sequence", gen.stop_string
    return "end_turn", None


def tool_use_blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])}
            for c in reply.get("tool_calls") or []]


def _usage(prep: PreparedChat, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": len(prep.rendered.prompt_ids), "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _headers(prep: PreparedChat) -> dict[str, str] | None:
    return {CAPPED_HEADER: str(prep.params[0].max_tokens)} if prep.capped_from is not None else None


class MessagesAPI:
    """The route's work, given the gateway (`prepare_chat`, `run_chat`, and what `chat_events` needs)."""

    def __init__(self, gw):
        self.gw = gw

    async def create(self, body: MessagesRequest, episode: Episode | None):
        prep = await self.gw.prepare_chat(to_chat(body), episode, cap_max_tokens=True)
        message_id = "msg_" + secrets.token_hex(12)
        if body.stream:
            return StreamingResponse(self._stream(prep, episode, message_id), media_type="text/event-stream",
                                     headers=_headers(prep))
        [(reply, gen)] = await self.gw.run_chat(prep, episode)
        content = ([{"type": "text", "text": reply["content"]}] if reply.get("content") else []) + tool_use_blocks(reply)
        reason, sequence = stop_reason(prep, reply, gen)
        return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": prep.policy.name,
                             "content": content, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": _usage(prep, len(gen.token_ids))}, headers=_headers(prep))

    async def count_tokens(self, body: CountTokensRequest, episode: Episode | None) -> dict[str, int]:
        """`POST /v1/messages/count_tokens`: the prompt's exact length, rendered as `create` renders it
        (token reuse included); nothing generated, counted or recorded."""
        _, rendered, _, _ = await self.gw.render_turn(to_chat(body), episode)
        return {"input_tokens": len(rendered.prompt_ids)}

    async def _stream(self, prep: PreparedChat, episode: Episode | None, message_id: str) -> AsyncIterator[bytes]:
        def event(kind: str, **fields) -> bytes:
            return sse({"type": kind, **fields}, kind)

        yield event("message_start", message={
            "id": message_id, "type": "message", "role": "assistant", "model": prep.policy.name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(prep, 0)})
        yield event("ping")
        text_open = False
        events = chat_events(self.gw, prep, episode)
        try:
            async for ev in events:
                if isinstance(ev, TextDelta):
                    if not text_open:
                        yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                        text_open = True
                    yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": ev.text})
                elif isinstance(ev, ChoiceFailed):
                    kind = "invalid_request_error" if ev.type == "conflict_error" else "api_error"
                    yield event("error", error={"type": kind, "message": ev.message})
                else:
                    if text_open:
                        yield event("content_block_stop", index=0)
                    for k, call in enumerate(ev.reply.get("tool_calls") or [], int(text_open)):
                        block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                        yield event("content_block_start", index=k, content_block=block)
                        yield event("content_block_delta", index=k,  # the model's own argument text
                                    delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
                        yield event("content_block_stop", index=k)
                    reason, sequence = stop_reason(prep, ev.reply, ev.gen)
                    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                usage={"output_tokens": len(ev.gen.token_ids)})
                    yield event("message_stop")
        finally:
            await events.aclose()
