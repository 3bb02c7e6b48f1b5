"""Server-sent events for streamed chat completions.

Text streams token by token as the engine samples it, held back only where a stop string might still
be forming or a UTF-8 character is incomplete. When tools are offered, the reply is sent whole at the
end, because a tool call is only known once its closing tag has arrived. Recording happens exactly as
for non-streamed calls, once a choice is complete. Each choice's engine await is bounded by
`server.request_timeout_s`; a choice that fails or times out is reported in-stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from core.episodes.registry import EpisodeError
from core.serve.state import Policy
from core.serve.openai_wire import ChatRequest


class IncrementalText:
    """The text of a growing list of token ids, decoding a short window per token instead of the whole list.

    Decoding token by token is not enough (a token's text can depend on the one before it, and a
    UTF-8 character may span tokens), so each new token is decoded together with the tokens since
    the last stable point, and the difference against the window without it is the new text. Text
    is only taken once it does not end in half a character. O(n) over a completion, where decoding
    the whole completion at every token was O(n^2) on the event loop (the vLLM/TGI scheme).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids, self.text = decode, [], ""
        self._prefix = self._read = 0  # window start; end of what is already in `text`

    def add(self, token: int) -> str:
        """Append one token; returns the stable text so far."""
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix : self._read])
        now = self.decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


def sse(data: dict | str) -> bytes:
    """One server-sent event: a JSON object, or a bare string such as `[DONE]`."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def stream_chat(gw, policy: Policy, body: ChatRequest, messages, rendered, params, tools_offered,
                      episode) -> AsyncIterator[bytes]:
    """The SSE body of one streamed chat completion. `gw` is the gateway that renders and records
    (`text_of`, `make_call`, `record`): passed in, so this module never imports the gateway."""
    chunk_id, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
    hold = max((len(s) for s in body.stop or ()), default=1) - 1

    def chunk(index: int, delta: dict, finish: str | None = None) -> bytes:
        return sse({"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": policy.name,
                    "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    events: asyncio.Queue = asyncio.Queue()
    texts = [IncrementalText(policy.renderer.completion_text) for _ in params]
    sent = [""] * len(params)
    longest_stop = max((len(s) for s in body.stop or ()), default=0)

    timeout = gw.server.cfg.server.request_timeout_s

    async def run(i: int):
        try:
            gen = await asyncio.wait_for(policy.engine.generate(
                rendered.prompt_ids, params[i], on_token=lambda t: events.put_nowait((i, t))), timeout)
            events.put_nowait((i, gen))
        except TimeoutError:
            events.put_nowait((i, TimeoutError(f"no answer within server.request_timeout_s ({timeout:g} s)")))
        except Exception as e:  # reported in-stream: the HTTP status is already sent
            events.put_nowait((i, e))

    tasks = [asyncio.create_task(run(i)) for i in range(len(params))]
    try:
        for i in range(len(params)):
            yield chunk(i, {"role": "assistant", "content": ""})
        done, completion_tokens = 0, 0
        while done < len(params):
            i, item = await events.get()
            if isinstance(item, int):
                if tools_offered:
                    continue
                text = texts[i].add(item)
                safe = text[: len(text) - hold] if hold else text
                # What was sent held no stop string, so a new one overlaps the new text: search only there.
                fresh = safe[max(0, len(sent[i]) - longest_stop + 1) :]
                if len(safe) > len(sent[i]) and not any(s in fresh for s in body.stop or ()):
                    yield chunk(i, {"content": safe[len(sent[i]) :]})
                    sent[i] = safe
                continue
            done += 1
            if isinstance(item, Exception):
                yield sse({"error": {"message": f"generation failed: {item}", "type": "server_error", "code": None}})
                continue
            gen = item
            reply = policy.renderer.parse_reply(gw.text_of(policy, gen), tools_offered)
            try:
                gw.record(episode, gw.make_call(policy, messages, rendered, gen, reply))
            except EpisodeError as e:  # the lease ran out while generating
                yield sse({"error": {"message": str(e), "type": "conflict_error", "code": e.code}})
                continue
            completion_tokens += len(gen.token_ids)
            delta: dict = {}
            final_text = reply.get("content") or ""
            if final_text.startswith(sent[i]) and len(final_text) > len(sent[i]):
                delta["content"] = final_text[len(sent[i]) :]
            if reply.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(reply["tool_calls"])]
            if delta:
                yield chunk(i, delta)
            yield chunk(i, {}, "tool_calls" if reply.get("tool_calls") else gen.finish_reason)
        if body.stream_options and body.stream_options.include_usage:
            prompt = len(rendered.prompt_ids)
            yield sse({"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": policy.name,
                       "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                                                "total_tokens": prompt + completion_tokens}})
        yield sse("[DONE]")
    finally:
        for t in tasks:
            t.cancel()
