"""Request bodies parsed and validated into wire types: small ones inline, large ones off the event loop.

FastAPI parses a declared body with `json.loads` and validates it with pydantic on the event loop:
a body near `server.max_request_bytes` (8 MiB) held every other request of the server for over a
second. The OpenAI-compatible routes therefore take the raw request and call `BodyParser.read`:
a small body is parsed inline (a thread hop costs more), a medium one on a worker thread, and a
large one in a child process, because `json.loads` and pydantic hold the GIL for their whole C-level
run (a 4M-id prompt list: ~0.3 s quiet) and a thread would stall the loop all the same. The child
refuses a token-id prompt longer than its model's context itself, so a huge list never comes back
across the pipe to be unpickled under the GIL. A malformed body raises FastAPI's
`RequestValidationError`, so the gateway's one handler turns it into the same 400 naming the field.

`openapi_bodies` puts the wire types back into the OpenAPI document, since routes that read the raw
request declare no body of their own (the fuzz tests generate requests from that document).
This module parses; it does not route, render or check limits (`core.serve.body_limit` does bytes).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from core.serve.openai_wire import WireError

# Below this many bytes a body is validated inline: the hop to a thread (~0.1 ms) costs more than
# parsing it (~64 KiB of JSON parses in ~0.3 ms), and small bodies are nearly every agent call.
INLINE_BYTES = 64 * 1024
# From this many bytes a body is parsed in the child process: ~1 MiB of JSON holds the GIL for
# ~5-40 ms (one long string vs a list of small numbers), the most a thread may take from the loop.
CHILD_BYTES = 2**20
REF = "#/components/schemas/{model}"
# Deepest nesting a body may have. A real request nests a few levels per level of a tool's schema; a
# hostile one 3000 levels deep made json, pydantic and the template's `tojson` recurse past Python's
# limit (RecursionError, a 500). Refusing deeper bodies at parse time keeps every later walk shallow.
MAX_DEPTH = 100
# A JSON escape of a UTF-16 surrogate: the only way a decoded body can hold a lone one ("\ud800"),
# which no tokenizer encodes and no JSON response can carry. Bodies without one skip that check.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

M = TypeVar("M", bound=BaseModel)


def first_fault(data: Any, surrogates: bool) -> tuple[tuple, str] | None:
    """(path, why) of the first place in a decoded body nested deeper than `MAX_DEPTH`, or (with
    `surrogates`) holding a string or key that is not valid UTF-8 text; None when there is none.
    Iterative, so a deep body cannot make it recurse; scalars other than strings are skipped."""
    stack: list[tuple[Any, tuple | None, int]] = [(data, None, 1)]  # (value, (parent path node, key), depth)

    def path(node: tuple | None) -> tuple:
        keys = []
        while node is not None:
            node, key = node
            keys.append(key)
        return tuple(reversed(keys))

    while stack:
        value, node, depth = stack.pop()
        if isinstance(value, str):
            if surrogates and not _encodable(value):
                return path(node), "holds text that cannot be encoded as UTF-8 (a lone surrogate?)"
            continue
        if depth > MAX_DEPTH:
            return path(node), f"is nested deeper than {MAX_DEPTH} levels"
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if surrogates and isinstance(key, str) and not _encodable(key):
                return path((node, key)), "is a key that cannot be encoded as UTF-8 (a lone surrogate?)"
            if isinstance(item, (dict, list)) or (surrogates and isinstance(item, str)):
                stack.append((item, (node, key), depth + 1))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate(model: type[M], raw: bytes) -> M:
    """JSON text to a wire type: what `BodyParser.read` runs inline, on a thread or in the child. `json.loads`, not
    pydantic's own parser: that one refuses a lone surrogate escape ("\\ud800") as invalid JSON, where
    the check here names the field that holds it. A body nested too deep, or holding a lone surrogate
    anywhere (an ignored field included: it would still be echoed or rendered), is refused here, before
    anything is generated or recorded."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": f"invalid JSON: {e}"}]) from None
    except RecursionError:
        raise RequestValidationError([{"type": "value_error", "loc": ("body",),
                                       "msg": f"body is nested deeper than {MAX_DEPTH} levels"}]) from None
    if isinstance(data, (dict, list)):
        fault = first_fault(data, surrogates=SURROGATE_ESCAPE.search(raw) is not None)
        if fault is not None:
            where, why = fault
            raise RequestValidationError([{"type": "value_error", "loc": ("body", *where), "msg": why}])
    return model.model_validate(data)


def _errors(e: Exception) -> list[dict[str, Any]]:
    """A validation failure as FastAPI's error list (without the input: it may be the whole body)."""
    if isinstance(e, RequestValidationError):
        return [{k: v for k, v in err.items() if k != "input"} for err in e.errors()]
    return [{**{k: v for k, v in err.items() if k != "input"}, "loc": ("body", *err["loc"])}
            for err in e.errors(include_url=False, include_context=False)]


def _child_validate(model: type[M], raw: bytes, contexts: dict[str, int]) -> tuple[str, Any]:
    """In the child process: ("ok", body), ("invalid", errors) or ("too_long", (ids, context))."""
    try:
        body = validate(model, raw)
    except (RequestValidationError, ValidationError) as e:
        return "invalid", _errors(e)
    prompt, context = getattr(body, "prompt", None), contexts.get(getattr(body, "model", ""))
    if isinstance(prompt, list) and context is not None and len(prompt) >= context:
        return "too_long", (len(prompt), context)
    return "ok", body


class BodyParser:
    """Parses the routes' bodies; owns the child process large bodies go to (started on first use)."""

    def __init__(self, contexts: Callable[[], dict[str, int]]):
        self.contexts = contexts  # model name -> max context, for the child's length refusal
        self._child: ProcessPoolExecutor | None = None

    async def read(self, request: Request, model: type[M]) -> M:
        """The request's body as `model`; medium bodies parsed on a thread, large ones in the child."""
        raw = await request.body()
        try:
            if len(raw) < INLINE_BYTES:
                return validate(model, raw)
            if len(raw) < CHILD_BYTES:
                return await asyncio.to_thread(validate, model, raw)
        except ValidationError as e:
            raise RequestValidationError(_errors(e)) from None
        if self._child is None:  # spawn, not fork: the server has threads (engines, uvicorn)
            self._child = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        try:
            kind, result = await loop.run_in_executor(self._child, _child_validate, model, raw, self.contexts())
        except BrokenProcessPool:  # the child was killed (out of memory?): the next large body starts another
            self._child = None
            raise WireError("the process that parses large bodies died; send the request again",
                            "parser_unavailable", 503) from None
        if kind == "invalid":
            raise RequestValidationError(result)
        if kind == "too_long":
            raise WireError(f"prompt is {result[0]} tokens; the model's context is {result[1]}",
                            "context_length_exceeded")
        return result

    def close(self) -> None:
        if self._child is not None:
            self._child.shutdown(wait=False, cancel_futures=True)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose body is `model` (read by `read_body`, not declared)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def openapi_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` list `models` (and what they reference) under components.schemas."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build
