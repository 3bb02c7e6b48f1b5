"""The one failure type of every request the server refuses: `Refusal`, with the HTTP status it maps to.

The registry, the client table, the episode opener, the wire types and the gateway all raise this
one type, and `core.serve.errors` renders it, in one place, as the body the caller's API expects
(OpenAI-shaped, or Anthropic-shaped on `/v1/messages`). It lives here, below `core/serve/`, so the
episode books can refuse a request without knowing HTTP. It deliberately holds no rendering and no
status-to-type table: what a body looks like is the HTTP side's business.
"""

from __future__ import annotations


class Refusal(Exception):
    """A request refused: `status` (the HTTP status), `code` (a stable machine-readable name), the
    message a person reads, `retry_after` (seconds; a 503 that may ease says when to try again) and
    `param` (the request field at fault, when one is)."""

    def __init__(self, status: int, message: str, code: str | None = None, retry_after: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.retry_after, self.param = status, code, retry_after, param

    @property
    def message(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"Refusal({self.status}, {self.message!r}, {self.code!r})"
