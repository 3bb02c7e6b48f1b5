"""Chat rendering with token-in-token-out, and parsing of tool calls out of completions.

`ChatRenderer.render` turns OpenAI messages into prompt ids. When the messages extend an earlier call
of the same episode (that call's messages plus the exact reply we returned), the earlier call's
`prompt_ids + completion_ids` are reused verbatim and only the new suffix is tokenised, so the model
trains on the tokens it produced rather than on a re-tokenisation. Each render reports whether a
fresh tokenisation would have drifted from the reused ids, and whether the history was edited so
that no reuse was possible.

Echoed tool calls are rendered in one canonical text (`core.serve.tool_calls`), so the prompt does
not depend on how a harness re-serialises JSON.
This module knows the chat template and the tokenizer; it does not generate or store anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.records import Call
from core.serve.tool_calls import canonical, normalize, parse_reply

SENTINEL = "\x00swarmrl-sentinel\x00"  # cannot occur in real content, so it splits a rendering cleanly
# A tool name no client sends (and that `tojson` writes as itself): where a template puts a call's name.
NAME_SENTINEL = "swarmrl_sentinel_tool_name"
# How a failed tool result (`is_error`) reads when the chat template has no place of its own for it:
# the model must see that the call failed, and a template that never mentions `is_error` would drop it.
ERROR_MARK = "Error: "


class TemplateError(ValueError):
    """The messages or tools cannot be rendered by the model's chat template."""


class PromptTooLong(ValueError):
    """The rendered text's byte length alone proves the prompt longer than the context: not tokenized."""

    def __init__(self, at_least: int, max_context: int):
        super().__init__(f"prompt is at least {at_least} tokens; the model's context is {max_context}")
        self.at_least, self.max_context = at_least, max_context


@dataclass
class Rendered:
    prompt_ids: list[int]
    reused_prefix: int  # leading ids copied from an earlier call
    drift: bool  # a fresh tokenisation would have given different ids than the reused ones
    broken: bool  # the messages extend the episode's history only after an edit: no reuse possible
    # The messages as rendered, echoed tool calls in canonical text (`core.serve.tool_calls.canonical`):
    # what the call records, so a later turn finds it whatever JSON its harness writes.
    messages: list[dict] = field(default_factory=list)


class ChatRenderer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        self.turn_close = self._turn_close()
        self._end_ids = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
        # No token stands for more UTF-8 bytes than its own vocabulary string takes (byte-level BPE
        # writes a byte as one or two characters, sentencepiece a space as the 3-byte "▁"), so a text
        # of B bytes is at least B / this many tokens: what `at_least_tokens` proves before tokenizing.
        # It assumes the tokenizer's normaliser does not delete text (none of the causal LMs' do).
        self.max_token_bytes = max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()), default=1) or 1
        template = tokenizer.chat_template
        # Whether the template renders a tool message's `is_error` itself (else `ERROR_MARK` shows it).
        self.error_place = "is_error" in (template if isinstance(template, str) else str(template or ""))

    def _template(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja errors carry the template's own message; surface it as bad input
            raise TemplateError(f"chat template cannot render these messages: {e}") from None

    def _turn_close(self) -> str:
        """The text a template writes after an assistant message's content (ChatML: '<|im_end|>\\n')."""
        text = self._template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}], None, False
        )
        return text.split(SENTINEL, 1)[1] if SENTINEL in text else ""

    def completion_text(self, ids: list[int]) -> str:
        """A completion's text: end-of-turn and padding dropped, other special tokens (tool tags) kept."""
        return self.tok.decode([t for t in ids if t not in self._end_ids], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def at_least_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, from its byte length alone (no tokenizing)."""
        return -(-len(text.encode("utf-8", "replace")) // self.max_token_bytes)

    def check_length(self, text: str, max_context: int | None, already: int = 0) -> None:
        """Raise `PromptTooLong` when `already` ids plus `text` cannot fit `max_context`, before tokenizing it."""
        if max_context is not None and (at_least := already + self.at_least_tokens(text)) > max_context:
            raise PromptTooLong(at_least, max_context)

    def call_prefix(self, name: str | None) -> str | None:
        """The text the template writes at the start of an assistant turn that is one tool call, up to
        where the model must go on: before the name (`name` None: any call), or before the arguments
        (a named tool). Forcing it constrains a reply's first tokens to a call (`tool_choice`). None
        when this template writes no call there (content first, or no calls at all)."""
        user = [{"role": "user", "content": "x"}]
        head = self._template(user, None, True)
        call = {"id": "c", "type": "function", "function": {"name": name or NAME_SENTINEL, "arguments": SENTINEL}}
        try:
            turn = self._template(user + [{"role": "assistant", "content": None, "tool_calls": [call]}], None, False)
        except TemplateError:
            return None
        if not turn.startswith(head) or SENTINEL not in turn:
            return None
        written = turn[len(head) :]
        cut = written.find(SENTINEL) if name else written.find(NAME_SENTINEL)
        return written[:cut] if cut > 0 else None

    def render(self, messages: list[dict], tools: list[dict] | None, history: list[Call] = (),
               max_context: int | None = None, forced: str = "") -> Rendered:
        """Prompt ids for `messages`, echoed tool calls in canonical text (their stored replies' where
        they match one), then `forced` (text the reply must start with, already decided); with
        `max_context`, a prompt whose text alone proves it longer is refused (`PromptTooLong`) before
        any tokenization."""
        messages = canonical(self._errors_shown(messages), [c.reply for c in history if c.reply is not None])
        full_text = self._template(messages, tools, True) + forced
        self.check_length(full_text, max_context)
        fresh: list[int] | None = None
        earlier, edited = _find_extended_call(messages, history)
        if earlier is not None:
            replied = earlier.messages + [earlier.reply]
            prefix_text = self._template(replied, tools, False)
            if full_text.startswith(prefix_text):
                close = self.turn_close
                if earlier.completion_ids and earlier.completion_ids[-1] == self.tok.eos_token_id:
                    close = close[len(self.eos_text) :] if close.startswith(self.eos_text) else close
                reused = earlier.prompt_ids + earlier.completion_ids
                suffix = close + full_text[len(prefix_text) :]
                self.check_length(suffix, max_context, already=len(reused))
                ids = reused + self.encode(suffix)
                fresh = self.encode(full_text)
                return Rendered(ids, len(reused), drift=fresh != ids, broken=False, messages=messages)
            edited = True  # same messages, different rendering (tools changed): not append-only
        fresh = self.encode(full_text)
        return Rendered(fresh, 0, drift=False, broken=edited, messages=messages)

    def _errors_shown(self, messages: list[dict]) -> list[dict]:
        """Failed tool results as the model sees them: the `is_error` key where the template has a place
        for it, else `ERROR_MARK` before the content."""
        if self.error_place or not any(m.get("is_error") for m in messages):
            return messages
        return [{**{k: v for k, v in m.items() if k != "is_error"}, "content": ERROR_MARK + (m.get("content") or "")}
                if m.get("is_error") else m for m in messages]

    def parse_reply(self, text: str, tools_offered: bool) -> dict[str, Any]:
        """The OpenAI assistant message for a completion's text (`core.serve.tool_calls.parse_reply`)."""
        return parse_reply(text, tools_offered)


def _find_extended_call(messages: list[dict], history: list[Call]) -> tuple[Call | None, bool]:
    """The latest, longest earlier call that `messages` extend; and whether some call was extended only after an edit."""
    norm = [normalize(m) for m in messages]
    best: Call | None = None
    edited = False
    for call in reversed(history):
        if call.reply is None or not call.messages:
            continue
        n = len(call.messages)
        if len(norm) <= n:
            continue
        if [normalize(m) for m in call.messages] != norm[:n]:
            continue
        if normalize(call.reply) != norm[n]:
            edited = True  # same context, but the client changed what the model said
            continue
        if best is None or n > len(best.messages):
            best = call
    return best, edited and best is None
