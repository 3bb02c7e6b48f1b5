"""A scripted OpenAI-compatible server standing in for a remote LLM in unit tests.

It answers `POST /v1/chat/completions` with the next scripted reply and remembers every request.
A scripted reply is the text of a completion, or `(status, body)` for an HTTP error. By default it
ignores `response_format` (as many servers do); with `reject_format` it refuses any request that
carries one with a 400 naming the field, as servers without structured output do.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

# What a server without structured output answers to a request that carries `response_format`.
FORMAT_REFUSAL = {"error": {"message": "response_format is not supported by this server", "type": "invalid_request_error",
                            "param": "response_format", "code": None}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedLLM:
    def __init__(self, replies: list[str | tuple[int, dict[str, Any]]], usage: bool = True,
                 reject_format: bool = False) -> None:
        self.replies, self.usage, self.requests = list(replies), usage, []  # type: list[dict[str, Any]]
        self.reject_format = reject_format
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._complete)

    async def _complete(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append(body)
        if self.reject_format and "response_format" in body:
            return JSONResponse(FORMAT_REFUSAL, status_code=400)
        text = self.replies.pop(0) if self.replies else "no more scripted replies"
        if isinstance(text, tuple):
            return JSONResponse(text[1], status_code=text[0])
        out: dict[str, Any] = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": text}}]}
        if self.usage:
            out["usage"] = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
        return out


@contextmanager
def serve(llm: ScriptedLLM) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(llm.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(5)
