"""How a refused request looks on the wire: the one place a `core.episodes.errors.Refusal` becomes a body.

Every API answers in the shape its official SDK parses: OpenAI-shaped by default,
`{"error": {"message", "type", "code", "param"}}` (the swarm routes too: the swarm SDK reads that),
and Anthropic-shaped on the Messages routes (`/v1/messages`, `/episodes/{secret}/v1/messages`),
`{"type": "error", "error": {"type", "message", "code"}}` with Anthropic's error types (`code`, ours,
is extra: the anthropic SDK reads the other two). A 503 that may ease
carries `Retry-After` (whole seconds, at least 1) in either shape. Status and code are the
`Refusal`'s own, whatever the shape. This module renders; it decides nothing and raises nothing.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from core.episodes.errors import Refusal

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                422: "invalid_request_error", 500: "server_error", 503: "service_unavailable",
                504: "timeout_error"}
# Anthropic's documented error types (docs.anthropic.com, "Errors"); a status it has no type for is an
# `api_error`, as Anthropic answers its own unexpected failures. A 409 is a request the episode's state
# refuses: the caller's to fix, so `invalid_request_error`; a 503 is Anthropic's `overloaded_error`.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 504: "api_error"}
MESSAGES_ROUTE = "/v1/messages"  # the Anthropic API's route, keyed or under /episodes/{secret}


def is_anthropic(path: str) -> bool:
    """Whether a request path is one of the Anthropic Messages routes (their errors are Anthropic-shaped)."""
    return path.startswith(MESSAGES_ROUTE) or (path.startswith("/episodes/") and MESSAGES_ROUTE in path)


def error_body(path: str, e: Refusal) -> dict:
    """The JSON body of `e` for a request to `path`."""
    if is_anthropic(path):
        # `code` beside Anthropic's two fields: the SDK ignores it, and a caller keeps the same stable code.
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message,
                                           "code": e.code}}
    return {"error": {"message": e.message, "type": OPENAI_TYPES.get(e.status, "server_error"), "code": e.code,
                      "param": e.param}}


def headers_of(e: Refusal) -> dict[str, str]:
    """`Retry-After` when the refusal says when to retry (HTTP allows whole seconds only)."""
    return {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after is not None else {}


def error_response(path: str, e: Refusal) -> JSONResponse:
    """`e` as the response a request to `path` gets."""
    return JSONResponse(error_body(path, e), status_code=e.status, headers=headers_of(e) or None)


def error_bytes(path: str, e: Refusal) -> bytes:
    """`e`'s body as bytes, for ASGI middleware that answers before the app (`core.serve.body_limit`)."""
    return json.dumps(error_body(path, e)).encode()
