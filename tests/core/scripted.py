"""A scripted LLM for the harness tests: the tiny model's tokenizer and template, fixed replies.

Each generation is the next of its replies, tokenized as the tiny model would write it and ended by
the end token, cut at the first stop string as an engine cuts it (`core.engine.detokenize`). It
keeps the prompts it was given, so a test can see what the template rendered. The tool paths need
replies a model this small cannot be trained to write (non-ASCII arguments, malformed calls), so
their tests run the real gateway, renderer and HTTP around these replies.
"""

from __future__ import annotations

from core.engine import Generation, scoring_temperature
from core.engine.detokenize import IncrementalText, StopMatcher
from core.engine.null import NullEngine
from core.models import build_tiny
from core.serve.chat import ChatRenderer
from core.serve.state import Policy


class ScriptedEngine(NullEngine):
    def __init__(self, tokenizer, replies: list[str]):
        super().__init__(tokenizer, 2048)
        self.tok, self.prompts = tokenizer, []
        self.replies = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in replies]

    async def generate(self, prompt_ids, params, on_token=None) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids, stop = self.replies.pop(0)[: params.max_tokens], None
        text, stops = IncrementalText(lambda w: self.tok.decode(w, skip_special_tokens=False)), StopMatcher(params.stop)
        for k, token in enumerate(ids):
            stop = stops.feed(text.add(token))
            if stop is not None:
                ids = ids[: k + 1]
                break
        for t in ids if on_token is not None else ():
            on_token(t)
        finish = "stop" if stop is not None or ids[-1] == self.tok.eos_token_id else "length"
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish, version=self.version,
                          temperature=scoring_temperature(params.temperature), top_p=params.top_p, stop_string=stop)


def scripted_policy(replies: list[str]) -> tuple[Policy, ScriptedEngine]:
    model, tok = build_tiny()
    engine = ScriptedEngine(tok, replies)
    return Policy("policy", model, tok, ChatRenderer(tok), engine), engine
