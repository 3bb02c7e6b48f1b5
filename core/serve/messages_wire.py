"""Wire types of the Anthropic Messages API (`POST /v1/messages`), and their conversion to a chat request.

A Messages request becomes the internal chat request in one place, `to_chat`: `system` a system
message; a user turn's `text` blocks a user message and each `tool_result` block a tool message, in
block order; an assistant turn's `text` blocks its content and its `tool_use` blocks its tool calls
(`input` as JSON text); tools (`input_schema`) chat function tools; `max_tokens`, `stop_sequences`,
`temperature` and `top_p` the chat sampling fields. So a Messages conversation renders to the very
ids its Chat Completions twin does. What the API offers and we do not (images, documents, thinking,
server tools, `top_k`) is refused with a 400 naming it, never silently ignored.
This module converts; routes and replies are `core.serve.messages`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.serve.openai_wire import MAX_STOP, ChatRequest, WireError, first_error


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # the SDK may send fields we do not use (service_tier): ignored


class InputMessage(_Open):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Open):
    model: str
    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None  # text, or text blocks
    tools: list[dict[str, Any]] | None = None  # custom tools: name, description, input_schema
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "tool" | "none", "name"?}
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None  # refused: the engines sample by temperature and top_p only
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted (user_id); not used
    thinking: dict[str, Any] | None = None  # refused unless disabled: no separate reasoning
    output_config: dict[str, Any] | None = None  # refused with a `format` (structured output); effort ignored
    mcp_servers: list[Any] | None = None  # refused unless empty: the server calls no tools itself
    container: str | dict[str, Any] | None = None  # refused: no code-execution container

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (len(v) > MAX_STOP or any(not s for s in v)):
            raise ValueError(f"stop_sequences takes at most {MAX_STOP} non-empty strings")
        return v


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False  # shown to the model: in the template's own place, else in the content (`core.serve.chat`)


class CustomTool(_Open):
    type: Literal["custom"] = "custom"
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


def _parse(model: type[BaseModel], data: dict[str, Any], where: str):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise WireError(f"{where}.{first_error(e)}", "invalid_block") from None


def _texts(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(_parse(TextBlock, _only(b, ("text",), f"{where}[{k}]"), f"{where}[{k}]").text
                   for k, b in enumerate(content))


def _only(block: dict[str, Any], kinds: tuple[str, ...], where: str) -> dict[str, Any]:
    if block.get("type") not in kinds:
        raise WireError(f"{where}: content block type {block.get('type')!r} is not supported here (allowed: "
                        f"{', '.join(kinds)})", "unsupported_block")
    return block


def _user(msg: InputMessage, where: str, used: set[str]) -> list[dict[str, Any]]:
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out: list[dict[str, Any]] = []
    for k, raw in enumerate(msg.content):
        at = f"{where}.content[{k}]"
        block = _only(raw, ("text", "tool_result"), at)
        if block["type"] == "tool_result":
            result = _parse(ToolResultBlock, block, at)
            if result.tool_use_id not in used:
                raise WireError(f"{at}.tool_use_id: {result.tool_use_id!r} names no tool_use block of an earlier "
                                "assistant message", "invalid_block")
            out.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": _texts(result.content, f"{at}.content"),
                        **({"is_error": True} if result.is_error else {})})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += _parse(TextBlock, block, at).text  # a run of text blocks is one user turn
        else:
            out.append({"role": "user", "content": _parse(TextBlock, block, at).text})
    return out


def _assistant(msg: InputMessage, where: str) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    text, calls = [], []
    for k, raw in enumerate(msg.content):
        at = f"{where}.content[{k}]"
        block = _only(raw, ("text", "tool_use"), at)
        if block["type"] == "text":
            text.append(_parse(TextBlock, block, at).text)
        else:
            use = _parse(ToolUseBlock, block, at)
            # The canonical text (`core.serve.tool_calls.canonical_arguments`): as Chat and Responses render it
            calls.append({"id": use.id, "type": "function",
                          "function": {"name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}})
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        out["tool_calls"] = calls
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for k, raw in enumerate(tools):
        if raw.get("type", "custom") != "custom":
            raise WireError(f"tools[{k}]: tool type {raw.get('type')!r} is not supported (custom tools only)",
                            "unsupported_tool")
        tool = _parse(CustomTool, raw, f"tools[{k}]")
        fn = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        out.append({"type": "function", "function": {k2: v for k2, v in fn.items() if v is not None}})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    kind = None if choice is None else choice.get("type")
    if kind is None:
        return None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise WireError(f"tool_choice {json.dumps(choice)} is not supported (auto, any, tool with a name, none)",
                    "unsupported_tool_choice")


def to_chat(body: MessagesRequest) -> ChatRequest:
    """The internal chat request for a Messages request (a 400 `WireError` for what it cannot carry)."""
    if body.top_k is not None:
        raise WireError("top_k is not supported (the engines sample by temperature and top_p)", "unsupported")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise WireError("thinking is not supported (the policies do not reason separately)", "unsupported")
    if body.output_config and body.output_config.get("format") is not None:
        raise WireError("output_config.format is not supported (plain text and tool calls only)", "unsupported")
    if body.mcp_servers:
        raise WireError("mcp_servers is not supported (the server calls no tools itself)", "unsupported")
    if body.container is not None:
        raise WireError("container is not supported (no code-execution container)", "unsupported")
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _texts(body.system, "system")})
    used: set[str] = set()  # the tool_use ids so far: what a tool_result may answer
    for k, msg in enumerate(body.messages):
        at = f"messages[{k}]"
        if msg.role == "user":
            messages += _user(msg, at, used)
        else:
            messages.append(_assistant(msg, at))
            used.update(c["id"] for c in messages[-1].get("tool_calls") or ())
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
                            "stream": body.stream}
    if (body.tool_choice or {}).get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    for field, value in (("tools", _tools(body.tools)), ("tool_choice", _tool_choice(body.tool_choice)),
                         ("stop", body.stop_sequences), ("temperature", body.temperature), ("top_p", body.top_p)):
        if value is not None:
            chat[field] = value
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as e:
        raise WireError(first_error(e), "invalid_request") from None


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens` (nothing is generated)."""

    max_tokens: int | None = Field(None, ge=1)
