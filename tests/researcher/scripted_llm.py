"""A scripted OpenAI-compatible server standing in for a remote LLM in unit tests.

It answers `POST /v1/chat/completions` with the next scripted reply and remembers every request.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedLLM:
    def __init__(self, replies: list[str], usage: bool = True) -> None:
        self.replies, self.usage, self.requests = list(replies), usage, []  # type: list[dict[str, Any]]
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._complete)

    async def _complete(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.requests.append(body)
        text = self.replies.pop(0) if self.replies else "no more scripted replies"
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
