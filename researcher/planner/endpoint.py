"""The llm planner's endpoint: which model to ask, how much it can hold, and requests that fit it.

Any OpenAI-compatible server works. The model is the one named (`--llm-model` / `OPENAI_MODEL`), or
else the endpoint's single served model, by the same rule as sandboxes. The context length comes from
the endpoint's `/v1/models` entry when it says (`max_model_len`, as vLLM and `swarm serve` report it),
or from the message of a 400 that refused a request as too long (OpenAI, vLLM and `swarm serve`
wordings). Each request then fits: `max_tokens` is lowered to the room the prompt leaves, and when
even the smallest reply would not fit, the oldest retry exchanges are dropped; both are logged.
A request may carry a JSON schema as `response_format` (structured output, as OpenAI and vLLM take
it); an endpoint that refuses the field with a 400 is asked again without it, and from then on
never with it. One that silently ignores it needs nothing: the caller checks every reply anyway.

This module sends requests; what the prompt says is `researcher.planner.llm`'s business.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import openai
from openai.types.chat import ChatCompletion

from researcher.planner.types import PlannerError

log = logging.getLogger(__name__)

# A planning call that takes longer than this is treated as a failed attempt.
TIMEOUT_S = 120.0
# Until the endpoint has told us its tokenizer's density, prompts are estimated at this many
# characters a token (typical for BPE vocabularies); a 400 or a `usage` field corrects it.
DEFAULT_CHARS_PER_TOKEN = 4.0
# A floor for the learned density, so that one odd prompt cannot make every estimate absurd.
MIN_CHARS_PER_TOKEN = 0.25
# Chat templates add a few tokens around every message that the text itself does not show.
TOKENS_PER_MESSAGE = 8
# Kept free under the context for estimation error: a refused request costs a round trip.
CONTEXT_MARGIN = 32
# A reply shorter than this cannot hold a plan: rather trim the prompt than ask for less.
MIN_REPLY_TOKENS = 128
# The first two messages (system, the planning request) are never dropped; later ones are retry
# exchanges (the invalid reply, the error) and go oldest first, in pairs.
KEPT_MESSAGES = 2

# Context-length refusals as servers word them: (pattern, group of the context, group of the prompt).
_REFUSALS = [
    # swarm serve: "prompt (1514) + max_tokens (1500) exceeds the model's context (2048)"
    (re.compile(r"prompt \((\d+)\) \+ max_tokens \(\d+\) exceeds the model's context \((\d+)\)"), 2, 1),
    # swarm serve: "prompt is 2100 tokens; the model's context is 2048"
    (re.compile(r"prompt is (\d+) tokens; the model's context is (\d+)"), 2, 1),
    # vLLM / OpenAI: "maximum context length is 2048 tokens. However, you requested 3014 tokens (1514 in the messages, ..."
    (re.compile(r"maximum context length is (\d+) tokens.*?\((\d+) in the messages", re.DOTALL), 1, 2),
    (re.compile(r"maximum context length is (\d+) tokens.*?messages resulted in (\d+) tokens", re.DOTALL), 1, 2),
]


def parse_context_refusal(message: str) -> tuple[int, int] | None:
    """(context length, prompt tokens) from a server's context-length 400, or None if it is another error."""
    for pattern, context_group, prompt_group in _REFUSALS:
        found = pattern.search(message)
        if found:
            return int(found.group(context_group)), int(found.group(prompt_group))
    return None


# A 400 that names one of these refused the structured-output request, not the prompt.
_FORMAT_WORDS = ("response_format", "json_schema", "guided_json", "structured output")


def refuses_response_format(message: str) -> bool:
    """Whether a server's 400 is about the `response_format` field (not supported, or its schema refused)."""
    lowered = message.lower()
    return any(word in lowered for word in _FORMAT_WORDS)


def error_usage(error: openai.APIError) -> int:
    """Tokens an error response says it spent (some servers send `usage` with an error); 0 when it says none."""
    response = getattr(error, "response", None)
    try:
        body = response.json() if response is not None else None
    except ValueError:
        return 0
    usage = body.get("usage") if isinstance(body, dict) else None
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and total > 0 else 0


def _chars(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


class Endpoint:
    """An OpenAI-compatible chat endpoint with a known (or discovered) model and context length."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none",
                                    max_retries=0, timeout=TIMEOUT_S)
        self.model = model or None  # None until discovered: the endpoint's single served model
        self.context: int | None = None  # the model's context length once known
        self.chars_per_token = DEFAULT_CHARS_PER_TOKEN
        self._discovered = False
        self.structured: bool | None = None  # takes `response_format` json_schema: None until a reply tells

    def discover(self) -> None:
        """Read `/v1/models` once: the single served model when none was named, and its context length."""
        if self._discovered:
            return
        try:
            entries = list(self.client.models.list())
        except openai.APIError as e:
            if self.model is None:
                raise PlannerError(f"no --llm-model given and {self.base_url}/models cannot be read: {e}") from None
            log.info("llm planner: %s/models unreadable (%s); the context is learned from refusals", self.base_url, e)
            entries = []
        if self.model is None:
            ids = sorted(m.id for m in entries)
            if len(ids) != 1:
                raise PlannerError(f"no --llm-model given and {self.base_url} serves {ids or 'no models'}: "
                                   "name one with --llm-model (or OPENAI_MODEL)")
            self.model = ids[0]
        for m in entries:
            extra: dict[str, Any] = m.model_extra or {}
            if m.id == self.model and isinstance(extra.get("max_model_len"), int):
                self.context = extra["max_model_len"]
        self._discovered = True

    def complete(self, messages: list[dict[str, str]], max_tokens: int, temperature: float,
                 schema: dict[str, Any] | None = None) -> ChatCompletion:
        """One chat completion that fits the model's context, asking for JSON that follows `schema` when
        given and the endpoint takes it. Sent again once when a 400 reveals the context, and once when
        a 400 refuses `response_format`."""
        self.discover()
        refitted = False
        while True:
            fmt = schema if self.structured is not False else None
            sent, fitted = self.fit(messages, max_tokens)
            try:
                reply = self._send(sent, fitted, temperature, fmt)
            except openai.BadRequestError as e:
                if fmt is not None and refuses_response_format(str(e)):
                    self.structured = False
                    log.warning("llm planner: %s refuses response_format (%s); asking for JSON in the prompt only",
                                self.base_url, e)
                    continue
                refusal = parse_context_refusal(str(e))
                if refusal is None or refitted:
                    raise
                refitted = True
                self.context = refusal[0]
                self._learn_density(sent, refusal[1])
                log.warning("llm planner: %s has a context of %d tokens and counts this prompt as %d; refitting",
                            self.model, refusal[0], refusal[1])
                continue
            if fmt is not None:
                self.structured = True
            return reply

    def _send(self, sent: list[dict[str, str]], max_tokens: int, temperature: float,
              schema: dict[str, Any] | None) -> ChatCompletion:
        extra: dict[str, Any] = {}
        if schema is not None:
            extra["response_format"] = {"type": "json_schema",
                                        "json_schema": {"name": "plan", "schema": schema, "strict": False}}
        reply = self.client.chat.completions.create(model=self.model or "", messages=sent,  # type: ignore[arg-type]
                                                    temperature=temperature, max_tokens=max_tokens, **extra)
        if reply.usage is not None:
            self._learn_density(sent, reply.usage.prompt_tokens)
        return reply

    def _learn_density(self, sent: list[dict[str, str]], prompt_tokens: int) -> None:
        """Characters per token of this model's tokenizer, from a prompt whose token count the server told us."""
        text_tokens = prompt_tokens - TOKENS_PER_MESSAGE * len(sent)
        if text_tokens > 0:  # below one character a token is real: byte tokenizers split what they cannot decode
            self.chars_per_token = max(MIN_CHARS_PER_TOKEN, _chars(sent) / text_tokens)

    def estimate(self, messages: list[dict[str, str]]) -> int:
        return int(_chars(messages) / self.chars_per_token) + TOKENS_PER_MESSAGE * len(messages)

    def fit(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[dict[str, str]], int]:
        """The messages to send and the `max_tokens` to ask for, within the context when it is known."""
        if self.context is None:
            return messages, max_tokens
        sent = list(messages)
        while self.context - self.estimate(sent) - CONTEXT_MARGIN < MIN_REPLY_TOKENS and len(sent) > KEPT_MESSAGES:
            sent = sent[:KEPT_MESSAGES] + sent[KEPT_MESSAGES + 2:]
        if len(sent) < len(messages):
            log.warning("llm planner: dropped the %d oldest retry message(s) to fit %s's context of %d tokens",
                        len(messages) - len(sent), self.model, self.context)
        room = self.context - self.estimate(sent) - CONTEXT_MARGIN
        if room < 1:
            raise PlannerError(f"the planning prompt (about {self.estimate(sent)} tokens) does not fit {self.model}'s "
                               f"context of {self.context} tokens: use a model with a longer context")
        if room < max_tokens:
            log.warning("llm planner: max_tokens lowered from %d to %d to fit %s's context of %d tokens "
                        "(prompt about %d tokens)", max_tokens, room, self.model, self.context, self.estimate(sent))
            return sent, room
        return sent, max_tokens
