"""A request body size limit, as ASGI middleware: a body over `server.max_request_bytes` gets 413.

A declared Content-Length over the limit is refused before a byte of the body is read; a body sent
without one (chunked) is counted as it arrives and refused once it passes the limit, so no more than
the limit is ever held in memory. The answer is a `Refusal`, rendered as every other one is (`core.serve.errors`).
This module knows bytes only: it does not parse, validate or route.
"""

from __future__ import annotations

from core.episodes.errors import Refusal
from core.serve.errors import error_bytes


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, send)
        # Read the body here, at most max_bytes of it, and hand the app the same messages again.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, send)
            chunks.append(message)
            more = message.get("more_body", False)

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, send) -> None:
        refusal = Refusal(413, f"request body is larger than server.max_request_bytes ({self.max_bytes} bytes)",
                          "request_too_large")
        body = error_bytes(scope.get("path", ""), refusal)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
