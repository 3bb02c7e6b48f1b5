"""Wire types of the OpenAI-compatible side of the swarm HTTP API (DESIGN §3.2): chat and completion requests.

Requests are validated here, so that every malformed body becomes a 400 with a message naming the
field before it reaches an engine. Responses follow the shapes the official `openai` package parses.
This module holds types only; routes live in `core.serve.gateway`. The swarm routes' own types are
`core.episodes.wire`, below this package, because the registry and the client table read them too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.episodes.errors import Refusal

MAX_N = 16  # completions per request: more is a batch job, not an agent call
# Stop strings a request may name, on every route. OpenAI allows 4, Anthropic's `stop_sequences` more
# (harnesses send a dozen); each is searched once per decoded piece (`core.engine.detokenize`), so 64
# refuses no harness and bounds what a request can make every decode step do.
MAX_STOP = 64
# Seeds are int64, as OpenAI documents them and torch takes them: 2**64 would fail in the engine.
# The n choices of one request use seed, seed + 1, ...: still in range for torch (it takes < 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class WireError(Refusal):
    """A request the wire types parse but cannot serve: an unsupported item, block, tool or field (400),
    or a previous response that is not kept (404). It is the one failure type (`core.episodes.errors.Refusal`),
    its arguments in the order the wire modules write them; the gateway renders it like any refusal."""

    def __init__(self, message: str, code: str, status: int = 400):
        super().__init__(status, message, code)


def first_error(e: ValidationError) -> str:
    """The first pydantic error as "field.path: message", the form every 400 of the gateway takes."""
    err = e.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err['msg']}" if where else err["msg"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use; ignore, don't fail


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef

    def to_template(self) -> dict[str, Any]:
        """The tool as every route hands it to the chat template: name, description and parameters only.
        Other keys (`strict`, which the Agents SDK sends) are accepted and not shown to the model, so
        the same tools render the same prompt on Chat, Responses and Messages."""
        fn = {"name": self.function.name, "description": self.function.description,
              "parameters": self.function.parameters}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class ToolCallFunction(_Open):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Open):
    type: Literal["text"]
    text: str


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # A tool message whose call failed (Anthropic's tool_result `is_error`, also taken here): shown to the
    # model where the chat template has a place for it, else in the content (`core.serve.chat`).
    is_error: bool | None = None

    def to_template(self) -> dict[str, Any]:
        """The plain dict the chat template sees: text content, `developer` read as `system`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.is_error:
            out["is_error"] = True
        return out


class StreamOptions(_Open):
    include_usage: bool = False


def _unencodable(value: Any, where: str = "") -> str | None:
    """The path of the first string in `value` that is not valid UTF-8 text (a lone surrogate such as
    "\\ud800", which JSON can carry and no tokenizer can encode), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _unencodable(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


class SamplingFields(_Open):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    # None: the server's engine.default_temperature. Below core.engine.GREEDY_BELOW (1e-4) decodes
    # greedily, exactly as 0 does (and is scored at T = 1): a smaller divisor only overflows float32.
    temperature: float | None = Field(None, ge=0, le=2)
    # Nucleus mass; however small (1e-300 rounds to 0 in float32), the most likely token is kept.
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # int64
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    # Refused unless empty: no engine applies a bias, and accepting one silently (NaN values included)
    # let a client believe it steered sampling. Validated as a map so a malformed one is a 400 too.
    logit_bias: dict[str, float] | None = None
    # Refused unless 0, for the same reason: no engine penalises repeats, so a non-zero one would be ignored.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        where = _unencodable(data)
        if where is not None:
            raise ValueError(f"{where} holds text that cannot be encoded as UTF-8 (a lone surrogate?)")
        return data

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by this server (no engine applies a bias); omit it or send {}")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info) -> float | None:
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server (no engine penalises repeats); "
                             "omit it or send 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings")
        return stops


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    # "required" and {"type": "function", "function": {"name"}} are enforced: the reply starts as a call
    # (the template's call text is forced before the first sampled token, `core.serve.tool_calls.forced_call`).
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: generation stops after the first call
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=0)  # only the sampled token's logprob is offered
    # Refused unless plain text: no engine constrains sampling to a JSON schema.
    response_format: dict[str, Any] | None = None
    functions: list[Any] | None = None  # the legacy form of tools: refused, send `tools`
    function_call: str | dict[str, Any] | None = None  # the legacy form of tool_choice: refused

    @model_validator(mode="after")
    def _served_as_asked(self) -> ChatRequest:
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not supported (no engine "
                             "constrains sampling to a schema); omit it or send {'type': 'text'}")
        for legacy, now in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, legacy) is not None:
                raise ValueError(f"{legacy} is not supported (the legacy form); send {now}")
        self._check_tool_choice()
        answered: set[str] = set()
        for k, m in enumerate(self.messages):
            answered.update(c.id for c in m.tool_calls or ())
            if m.role == "tool" and m.tool_call_id is None:
                raise ValueError(f"messages[{k}].tool_call_id: a tool message needs the id of the call it answers")
            if m.role == "tool" and m.tool_call_id not in answered:
                raise ValueError(f"messages[{k}].tool_call_id: {m.tool_call_id!r} names no tool call of an earlier "
                                 "assistant message")
        return self

    def _check_tool_choice(self) -> None:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or ()]
        if choice in (None, "none", "auto"):
            return
        if not names:
            raise ValueError(f"tool_choice: {choice!r} needs tools")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in names:
                raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or {{'type': 'function', "
                                 f"'function': {{'name': one of {names}}}}}")

    def forced_tool(self) -> str | None:
        """The tool the reply must call ("" for any, with "required"); None when the reply is free."""
        if self.tool_choice == "required":
            return ""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = False
