"""Stop strings: matched on incrementally decoded text, and never leaked by a stream.

Over real HTTP with the tiny model: a reply is generated once without a stop string, a stop string
is picked out of its text, and the same reply is asked for again with it (greedy, or the same seed,
so the tokens up to the stop are the same ones). The streamed text must then equal the recorded
reply, on Chat Completions and on Messages; and a stop string whose characters span byte tokens
(a 2-byte character on the byte-level tokenizer) must end the reply where it starts.
"""

from __future__ import annotations

import anthropic
import openai

from core.clients.sdk import SwarmClient
from core.engine.detokenize import StopMatcher
from core.serve.streaming import _Held

ASK = {"model": "policy", "max_tokens": 24}
SEEDS = range(24)  # sampled replies of the untrained tiny model hold a 2-byte character in most seeds


def first_pair(text: str, non_ascii: bool) -> int | None:
    """The index of the first 2-character stop candidate in `text` that occurs there first (whole
    characters only; with `non_ascii`, its second character takes more than one UTF-8 byte)."""
    for k in range(len(text) - 1):
        pair = text[k : k + 2]
        if "\ufffd" in pair or text.index(pair) != k:
            continue
        if not non_ascii or len(pair[1].encode()) > 1:
            return k
    return None


def recorded(server, ep) -> dict:
    return server.registry._open[ep.id].calls[-1].reply


def test_a_held_back_character_that_starts_a_stop_string_is_never_sent() -> None:
    held, sent = _Held(1, 1), []
    for piece in "xyab":  # one character a token, as the byte-level tokenizer decodes ASCII
        sent.append(held.take(piece, ["ab"]))
    assert "".join(sent) == "xy" and held.blocked


def test_a_stop_string_split_across_pieces_is_found_once_its_last_character_arrives() -> None:
    matcher = StopMatcher(["V椀"])
    assert [matcher.feed(p) for p in ("aV", "", "椀", "b")] == [None, None, "V椀", None]


def test_a_streamed_chat_reply_with_a_stop_string_equals_the_recorded_one(live_server) -> None:
    server = live_server()
    with SwarmClient(server.url).episode(task_id="stop-chat") as ep:
        ask = {**ASK, "messages": [{"role": "user", "content": "tell me"}], "temperature": 0}
        whole = ep.openai.chat.completions.create(**ask).choices[0].message.content
        k = first_pair(whole, non_ascii=False)
        assert k is not None, whole
        stream = ep.openai.chat.completions.create(**ask, stop=[whole[k : k + 2]], stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == recorded(server, ep)["content"] == whole[:k]
        ep.finish(0.0)


def test_a_streamed_message_with_a_stop_sequence_equals_the_recorded_one(live_server) -> None:
    server = live_server()
    with SwarmClient(server.url).episode(task_id="stop-messages") as ep:
        client = anthropic.Anthropic(base_url=ep.base_url.removesuffix("/").removesuffix("/v1"), api_key=ep.api_key,
                                     max_retries=0)
        ask = {**ASK, "messages": [{"role": "user", "content": "tell me"}], "extra_body": {"temperature": 0}}
        whole = "".join(b.text for b in client.messages.create(**ask).content)
        k = first_pair(whole, non_ascii=False)
        assert k is not None, whole
        with client.messages.stream(**ask, stop_sequences=[whole[k : k + 2]]) as events:
            streamed = "".join(ev.delta.text for ev in events
                               if ev.type == "content_block_delta" and ev.delta.type == "text_delta")
            final = events.get_final_message()
        assert streamed == recorded(server, ep)["content"] == whole[:k]
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", whole[k : k + 2])
        ep.finish(0.0)


def test_a_stop_string_with_a_character_split_across_byte_tokens_ends_the_reply(live_server) -> None:
    server = live_server()
    with SwarmClient(server.url).episode(task_id="stop-utf8", kind="debug") as ep:
        client: openai.OpenAI = ep.openai
        for seed in SEEDS:
            ask = {**ASK, "messages": [{"role": "user", "content": "tell me"}], "temperature": 1.0, "seed": seed}
            whole = client.chat.completions.create(**ask).choices[0].message.content
            k = first_pair(whole, non_ascii=True)
            if k is not None:
                break
        assert k is not None, "no sampled reply held a multi-byte character"
        stop = whole[k : k + 2]
        choice = client.chat.completions.create(**ask, stop=[stop]).choices[0]
        assert (choice.finish_reason, choice.message.content) == ("stop", whole[:k])
        stream = client.chat.completions.create(**ask, stop=[stop], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole[:k]
        assert recorded(server, ep)["content"] == whole[:k]
        ep.finish(0.0)
