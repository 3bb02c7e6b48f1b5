"""Wire types of the OpenAI-compatible side of the swarm HTTP API (DESIGN §3.2): chat and completion requests.

Requests are validated here, so that every malformed body becomes a 400 with a message naming the
field before it reaches an engine. Responses follow the shapes the official `openai` package parses.
This module holds types only; routes live in `core.serve.gateway`. The swarm routes' own types are
`core.episodes.wire`, below this package, because the registry and the client table read them too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16  # completions per request: more is a batch job, not an agent call
MAX_STOP = 4  # OpenAI's own limit on stop sequences


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use; ignore, don't fail


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


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
        return out


class StreamOptions(_Open):
    include_usage: bool = False


class SamplingFields(_Open):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: the server's engine.default_temperature
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None

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
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=0)  # only the sampled token's logprob is offered


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = False
