"""Wire types of the OpenAI Responses API (`POST /v1/responses`), and their conversion to a chat request.

A Responses request becomes the internal chat request in one place, `to_chat`: `instructions` a
system message, message items chat messages, `function_call` items the assistant's tool calls (joined
to the assistant message before them, as one chat turn holds text and calls), `function_call_output`
items tool messages, function tools chat tools, `max_output_tokens` `max_tokens`. So a Responses
conversation renders to the very ids its Chat Completions twin does. What the API offers and we do
not (built-in tools, reasoning, structured output, `include`, background runs, stored conversations,
images and files) is refused with a 400 naming it (`WireError`), never silently ignored.
This module converts; it does not route, generate or keep responses (`core.serve.responses` does).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.serve.openai_wire import ChatRequest, WireError, first_error


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # SDKs send fields we do not use (user, prompt_cache_key): ignored


class TextFormat(_Open):
    type: str = "text"  # only "text": json_schema / json_object structured output is refused


class TextConfig(_Open):
    format: TextFormat | None = None


class ResponsesRequest(_Open):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)  # text, or items (messages, function calls and outputs)
    instructions: str | None = None  # a system message before the input; not carried over from a previous response
    previous_response_id: str | None = None  # continue a response this server kept for the same episode
    tools: list[dict[str, Any]] | None = None  # function tools only
    tool_choice: str | dict[str, Any] | None = None  # "auto", "none", "required" or {"type": "function", "name"}
    parallel_tool_calls: bool | None = None  # False: generation stops after the first call
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True  # False: the response is not kept, so no later request can name it
    metadata: dict[str, str] | None = None  # echoed back
    text: TextConfig | None = None
    include: list[str] | None = None  # refused unless empty: no extra output data is offered
    reasoning: dict[str, Any] | None = None  # refused unless empty: the policies do not reason separately
    background: bool | None = None  # refused when true: every response is answered in its request
    conversation: str | dict[str, Any] | None = None  # refused: the server keeps responses, not conversations
    prompt: dict[str, Any] | None = None  # refused: no stored prompt templates
    truncation: Literal["auto", "disabled"] | None = None  # a prompt past the context is a 400 either way
    top_logprobs: int | None = None  # refused unless 0: only the sampled token's logprob is kept, and not sent
    max_tool_calls: int | None = None  # refused: a response is one model turn (use parallel_tool_calls: false)


class MessageItem(_Open):
    """A message item: easy form (`{"role", "content"}`) or output form (`type: message`, parts)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCall(_Open):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)  # what the function_call_output names
    name: str = Field(min_length=1)
    arguments: str  # JSON text


class FunctionCallOutput(_Open):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


class FunctionTool(_Open):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted, not shown to the model; arguments are parsed, not constrained while sampling


TEXT_PARTS = ("input_text", "output_text", "text")  # the text content parts; images, files, audio are refused


def _text(parts: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(parts, str):
        return parts
    out = []
    for k, part in enumerate(parts):
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            raise WireError(f"{where}[{k}]: content part type {kind!r} is not supported (text parts only: "
                              f"{', '.join(TEXT_PARTS)})", "unsupported_content")
        if not isinstance(part.get("text"), str):
            raise WireError(f"{where}[{k}].text: a text part needs a string 'text'", "invalid_content")
        out.append(part["text"])
    return "".join(out)


def _parse(model: type[BaseModel], item: dict[str, Any], where: str):
    try:
        return model.model_validate(item)
    except ValidationError as e:
        raise WireError(f"{where}.{first_error(e)}", "invalid_item") from None


def items_to_messages(items: str | list[dict[str, Any]], where: str = "input",
                      earlier: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Responses input items as chat messages (the template's form), after `earlier` (the previous
    responses' turns): a `function_call_output` must answer a call made in them or before it here."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    calls = {c["id"] for m in earlier for c in m.get("tool_calls") or ()}
    for k, item in enumerate(items):
        at = f"{where}[{k}]"
        kind = item.get("type", "message")
        if kind == "message":
            msg = _parse(MessageItem, item, at)
            out.append({"role": "system" if msg.role == "developer" else msg.role,
                        "content": _text(msg.content, f"{at}.content")})
        elif kind == "function_call":
            call = _parse(FunctionCall, item, at)
            calls.add(call.call_id)
            tool_call = {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
            if out and out[-1]["role"] == "assistant" and items[k - 1].get("type", "message") in ("message", "function_call"):
                out[-1].setdefault("tool_calls", []).append(tool_call)  # one chat turn: its text and its calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            result = _parse(FunctionCallOutput, item, at)
            if result.call_id not in calls:
                raise WireError(f"{at}.call_id: {result.call_id!r} names no function_call before it (in this input "
                                "or the previous response)", "invalid_item")
            out.append({"role": "tool", "tool_call_id": result.call_id, "content": _text(result.output, f"{at}.output")})
        else:
            raise WireError(f"{at}: item type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", "unsupported_item")
    return out


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    tools = []
    for k, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise WireError(f"tools[{k}]: tool type {tool.get('type')!r} is not supported (function tools only)",
                              "unsupported_tool")
        fn = _parse(FunctionTool, tool, f"tools[{k}]")
        spec: dict[str, Any] = {"name": fn.name, "description": fn.description}
        if fn.parameters is not None:
            spec["parameters"] = fn.parameters
        tools.append({"type": "function", "function": {k2: v for k2, v in spec.items() if v is not None}})
    return tools


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise WireError(f"tool_choice {json.dumps(choice)} is not supported (auto, none, required or a function)",
                      "unsupported_tool_choice")


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 for every field whose meaning we would otherwise silently drop."""
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        raise WireError(f"text.format {body.text.format.type!r} is not supported (plain text only)", "unsupported")
    for name in ("include", "reasoning"):
        if getattr(body, name):
            raise WireError(f"{name} is not supported", "unsupported")
    if body.top_logprobs:
        raise WireError("top_logprobs is not supported (only the sampled token's logprob is kept)", "unsupported")
    if body.max_tool_calls is not None:
        raise WireError("max_tool_calls is not supported (a response is one model turn); send "
                        "parallel_tool_calls: false for at most one call", "unsupported")
    for name in ("background", "conversation", "prompt"):
        if getattr(body, name):
            raise WireError(f"{name} is not supported: responses are answered in their request and kept by id "
                              "(previous_response_id)", "unsupported")


def to_chat(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request for `body` after `earlier` (the previous responses' turns), and this request's
    own new turns (its input items as messages: kept with the reply for a later previous_response_id)."""
    refuse_unsupported(body)
    new = items_to_messages(body.input, earlier=earlier)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat: dict[str, Any] = {"model": body.model, "messages": system + earlier + new, "stream": body.stream}
    for field, value in (("tools", _tools(body)), ("tool_choice", _tool_choice(body.tool_choice)),
                         ("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                         ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls)):
        if value is not None:
            chat[field] = value
    try:
        return ChatRequest.model_validate(chat), new
    except ValidationError as e:
        raise WireError(first_error(e), "invalid_request") from None
