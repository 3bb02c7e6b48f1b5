"""`POST /v1/responses`: the OpenAI Responses API over the one chat path, and the responses it keeps.

A request is converted to the internal chat request (`core.serve.responses_wire.to_chat`), run by
the gateway's chat path (the same rendering, token-in-token-out, tool-call parsing and `records.Call`
as Chat Completions), and its reply is converted back into output items: a `message` with one
`output_text` part, then one `function_call` per tool call. Streaming formats the chat path's events
(`core.serve.streaming.chat_events`) as the Responses event types, numbered by `sequence_number`.

`ResponseStore` keeps each stored response's own turns (its input as messages, and the reply) with
its parent's id, so `previous_response_id` rebuilds the conversation without copying it per turn.
A response is found only by requests of the episode that made it (anonymous ones only by anonymous
requests). The store is bounded; a response pushed out is a 404, as one never made.
This module does not render, generate or record; the gateway does.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from core.records import Episode
from core.serve.openai_wire import WireError
from core.serve.responses_wire import ResponsesRequest, to_chat
from core.serve.streaming import ChoiceDone, ChoiceFailed, PreparedChat, TextDelta, chat_events, sse

# Responses kept at most (each holds one turn's messages, not the conversation): an agent's turns for
# thousands of live episodes; older ones are dropped first and read as never made (404).
MAX_KEPT = 16_384


@dataclass
class _Kept:
    episode_id: str | None
    parent: str | None  # the previous_response_id it continued
    turns: list[dict[str, Any]]  # its input as chat messages, then its reply


class ResponseStore:
    """Responses by id, for `previous_response_id`; thread-safe (routes may run on worker threads)."""

    def __init__(self, max_kept: int = MAX_KEPT):
        self.max_kept, self._kept, self._lock = max_kept, OrderedDict[str, _Kept](), threading.Lock()

    def put(self, response_id: str, episode: Episode | None, parent: str | None, turns: list[dict]) -> None:
        with self._lock:
            self._kept[response_id] = _Kept(episode.id if episode else None, parent, turns)
            while len(self._kept) > self.max_kept:
                self._kept.popitem(last=False)

    def conversation(self, response_id: str, episode: Episode | None) -> list[dict[str, Any]]:
        """Every turn up to and including `response_id`'s reply; 404 when it is not kept for this episode."""
        chain, at = [], response_id
        with self._lock:
            while at is not None:
                kept = self._kept.get(at)
                if kept is None or kept.episode_id != (episode.id if episode else None):
                    raise WireError(f"previous_response_id {response_id!r} is not a response kept for this episode"
                                    + ("" if at == response_id else f" (its ancestor {at!r} is no longer kept)"),
                                    "previous_response_not_found", 404)
                chain.append(kept.turns)
                at = kept.parent
        return [m for turns in reversed(chain) for m in turns]


def output_items(reply: dict[str, Any], message_id: str) -> list[dict[str, Any]]:
    """The chat reply as Responses output items: its text as a message, its tool calls as function calls.
    An empty reply is an empty message, not no output: a client that resends its input items (the
    Agents SDK does) then carries the turn back, and the next call reuses its tokens."""
    items: list[dict[str, Any]] = []
    if reply.get("content") or not reply.get("tool_calls"):
        items.append(_message_item(message_id, reply.get("content") or "", "completed"))
    for call in reply.get("tool_calls") or []:
        items.append(_call_item(call, "completed"))
    return items


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


class ResponsesAPI:
    """The route's work, given the gateway (`prepare_chat`, `run_chat`, and what `chat_events` needs)."""

    def __init__(self, gw):
        self.gw, self.store = gw, ResponseStore()

    async def create(self, body: ResponsesRequest, episode: Episode | None):
        earlier = self.store.conversation(body.previous_response_id, episode) if body.previous_response_id else []
        chat_body, new_turns = to_chat(body, earlier)
        prep = await self.gw.prepare_chat(chat_body, episode)
        response_id = "resp_" + secrets.token_hex(16)
        if body.stream:
            return StreamingResponse(self._stream(body, prep, episode, response_id, new_turns),
                                     media_type="text/event-stream")
        [(reply, gen)] = await self.gw.run_chat(prep, episode)
        return self._finish(body, prep, episode, response_id, new_turns, reply, gen.finish_reason, len(gen.token_ids))

    async def input_tokens(self, body: ResponsesRequest, episode: Episode | None) -> dict[str, Any]:
        """`POST /v1/responses/input_tokens`: the prompt's exact length, rendered as `create` renders it
        (previous_response_id and token reuse included); nothing generated, counted or recorded."""
        earlier = self.store.conversation(body.previous_response_id, episode) if body.previous_response_id else []
        chat_body, _ = to_chat(body, earlier)
        _, rendered, _, _ = await self.gw.render_turn(chat_body, episode)
        return {"object": "response.input_tokens", "input_tokens": len(rendered.prompt_ids)}

    def _envelope(self, body: ResponsesRequest, prep: PreparedChat, response_id: str, status: str,
                  output: list, usage: dict | None, created: int) -> dict[str, Any]:
        params = prep.params[0]
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "model": prep.policy.name, "output": output, "instructions": body.instructions,
            "previous_response_id": body.previous_response_id, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": not prep.one_call,
            "temperature": params.temperature, "top_p": params.top_p, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "store": body.store, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage,
        }

    def _finish(self, body, prep, episode, response_id, new_turns, reply, finish_reason, completion_tokens,
                created: int | None = None) -> dict[str, Any]:
        """The whole response object for a reply, kept for later `previous_response_id` when stored."""
        if body.store:
            self.store.put(response_id, episode, body.previous_response_id, new_turns + [reply])
        prompt = len(prep.rendered.prompt_ids)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": prep.rendered.reused_prefix},
                 "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + completion_tokens}
        status = "incomplete" if finish_reason == "length" else "completed"
        return self._envelope(body, prep, response_id, status, output_items(reply, "msg_" + response_id[5:]), usage,
                              created or int(time.time()))

    async def _stream(self, body, prep, episode, response_id, new_turns) -> AsyncIterator[bytes]:
        seq, created, msg_id = 0, int(time.time()), "msg_" + response_id[5:]

        def event(kind: str, **fields) -> bytes:
            nonlocal seq
            seq += 1
            return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

        def text_open() -> list[bytes]:
            return [event("response.output_item.added", output_index=0, item=_message_item(msg_id, None, "in_progress")),
                    event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

        start = self._envelope(body, prep, response_id, "in_progress", [], None, created)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        texts: list[str] = []
        events = chat_events(self.gw, prep, episode)
        try:
            async for ev in events:
                if isinstance(ev, TextDelta):
                    if not texts:
                        for b in text_open():
                            yield b
                    texts.append(ev.text)
                    yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                delta=ev.text, logprobs=[])
                elif isinstance(ev, ChoiceFailed):
                    yield event("error", code=ev.code or ev.type, message=ev.message, param=None)
                    failed = self._envelope(body, prep, response_id, "failed", [], None, created)
                    failed["error"] = {"code": "server_error", "message": ev.message}
                    yield event("response.failed", response=failed)
                else:
                    if not texts and not ev.reply.get("tool_calls"):  # an empty reply: still a message item
                        for b in text_open():
                            yield b
                    for b in self._close_items(ev, texts, msg_id, event):
                        yield b
                    done = self._finish(body, prep, episode, response_id, new_turns, ev.reply, ev.gen.finish_reason,
                                        len(ev.gen.token_ids), created)
                    kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
                    yield event(kind, response=done)
        finally:
            await events.aclose()

    @staticmethod
    def _close_items(ev: ChoiceDone, texts: list[str], msg_id: str, event) -> list[bytes]:
        """The done events of the text item, then each function call whole (known only at the end)."""
        out, text, index = [], "".join(texts), 0
        if text or not ev.reply.get("tool_calls"):
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += [event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text,
                          logprobs=[]),
                    event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part),
                    event("response.output_item.done", output_index=0, item=_message_item(msg_id, text, "completed"))]
            index = 1
        for k, call in enumerate(ev.reply.get("tool_calls") or [], index):
            item = _call_item(call, "completed")
            out += [event("response.output_item.added", output_index=k, item=_call_item(call, "in_progress", "")),
                    event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                          delta=item["arguments"]),
                    event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                          arguments=item["arguments"], name=item["name"]),
                    event("response.output_item.done", output_index=k, item=item)]
        return out
