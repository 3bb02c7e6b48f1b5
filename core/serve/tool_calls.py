"""Tool calls in one canonical form: parsed out of a completion, compared, and echoed back.

A completion's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block (Hermes, the form
the policies' template writes) is a call only when its name is a non-empty string and its arguments
a JSON object; anything else stays in the reply's text, so every reply a harness gets can be sent
back on every route. A call's `arguments` is the model's own text for that object, not a
re-serialisation, so echoing it renders the very characters the model wrote.

Harnesses re-serialise the arguments they echo (`"Z\\u00fcrich"` for `"Zürich"`, `{"a":1}` for
`{"a": 1}`); `canonical` puts the stored reply's text back for every echoed call that `normalize`
matches, and writes any other call's arguments one way (`json.dumps`, non-ASCII kept), so the
prompt's tokens, and whether an earlier call's ids are reused, do not depend on the harness's JSON.
This module knows the call format; it does not render templates or tokenize (`core.serve.chat`).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from core.serve.openai_wire import WireError

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_CLOSE = "</tool_call>"  # where a call ends: with `parallel_tool_calls: false`, where generation stops
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_DECODER = json.JSONDecoder()


def _raw_members(text: str) -> dict[str, str]:
    """The members of a JSON object's text, each value as the exact text it was written with (a
    repeated key: the last, as `json.loads` takes it). `text` must already parse as an object."""
    out: dict[str, str] = {}
    i = _WS.match(text, text.index("{") + 1).end()
    while text[i] == '"':
        key, i = json.decoder.scanstring(text, i + 1)
        i = _WS.match(text, text.index(":", i) + 1).end()
        _, end = _DECODER.raw_decode(text, i)
        out[key] = text[i:end]
        i = _WS.match(text, end).end()
        if text[i] == ",":
            i = _WS.match(text, i + 1).end()
    return out


def _load(text: str) -> Any:
    """JSON text's value; ValueError for what is not JSON (RecursionError too: a model can nest deep)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(str(e)) from None


def _call(block: str) -> dict[str, Any] | None:
    """The OpenAI tool call one block holds, or None when it is not a call (name empty, arguments not an object)."""
    try:
        data = _load(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", {})
    if isinstance(args, str):  # arguments written as a JSON string holding the object
        try:
            text = args if isinstance(_load(args), dict) else None
        except ValueError:
            return None
    else:
        text = _raw_members(block.strip()).get("arguments", "{}") if isinstance(args, dict) else None
    if text is None:
        return None
    return {"id": "call_" + secrets.token_hex(8), "type": "function",
            "function": {"name": data["name"], "arguments": text}}


def parse_reply(text: str, tools_offered: bool) -> dict[str, Any]:
    """The OpenAI assistant message for a completion's text: each well-formed call parsed out when
    tools were offered; a malformed block stays in the content, where the model wrote it."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []  # the text outside the parsed calls
    at = 0
    for match in TOOL_CALL_RE.finditer(text) if tools_offered else ():
        call = _call(match.group(1))
        if call is not None:
            kept.append(text[at : match.start()])
            at = match.end()
            calls.append(call)
    if not calls:
        return {"role": "assistant", "content": text}
    content = ("".join(kept) + text[at:]).strip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def _json_key(arguments: Any) -> str:
    try:
        value = _load(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        value = arguments
    return json.dumps(value, sort_keys=True)


def normalize(message: dict[str, Any]) -> tuple:
    """What makes two messages the same turn: role, text and tool calls (arguments compared as JSON)."""
    calls = tuple((c.get("function", {}).get("name"), _json_key(c.get("function", {}).get("arguments") or "{}"))
                  for c in message.get("tool_calls") or [])
    return (message.get("role"), message.get("content") or "", calls)


def canonical_arguments(arguments: str) -> str:
    """A client's arguments text written one way (`json.dumps`, non-ASCII kept): the same whichever
    route or JSON library it came through. Text that is not JSON is kept as sent."""
    try:
        return json.dumps(_load(arguments), ensure_ascii=False)
    except ValueError:
        return arguments


def canonical(messages: list[dict[str, Any]], replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every assistant turn's tool-call arguments in canonical text: the stored reply's
    own (the model's characters) where `normalize` matches one of `replies`, else `canonical_arguments`."""
    stored = {normalize(r): r for r in replies if r.get("tool_calls")}
    out = []
    for m in messages:
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            continue
        reply = stored.get(normalize(m))
        texts = ([c["function"]["arguments"] for c in reply["tool_calls"]] if reply is not None else
                 [canonical_arguments(c["function"]["arguments"]) for c in m["tool_calls"]])
        out.append({**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": text}}
                                        for c, text in zip(m["tool_calls"], texts)]})
    return out


def forced_call(renderer, name: str | None) -> str:
    """The text a reply must start with for `tool_choice` (`ChatRequest.forced_tool`: None free, "" any
    call, else that tool's): the template's own call text up to the name or to the arguments
    (`ChatRenderer.call_prefix`). It goes into the prompt, so the model samples the rest of the call
    and is trained only on what it sampled. 400 when the template writes no call a reply can start with."""
    if name is None:
        return ""
    prefix = renderer.call_prefix(name or None)
    if prefix is None:
        raise WireError("tool_choice: this model's chat template writes no tool call a reply can start with; "
                        "send 'auto'", "unsupported_tool_choice")
    return prefix
