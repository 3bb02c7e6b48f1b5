"""Request bodies parsed and validated into wire types, large ones on a worker thread.

FastAPI parses a declared body with `json.loads` and validates it with pydantic on the event loop:
a body near `server.max_request_bytes` (8 MiB) held every other request of the server for over a
second. The OpenAI-compatible routes therefore take the raw request and call `read_body`, which
parses and validates inline when the body is small and on a
worker thread when it is large. A malformed body raises FastAPI's `RequestValidationError`, so the
gateway's one handler turns it into the same 400 naming the field.

`openapi_bodies` puts the wire types back into the OpenAPI document, since routes that read the raw
request declare no body of their own (the fuzz tests generate requests from that document).
This module parses; it does not route, render or check limits (`core.serve.body_limit` does bytes).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

# Below this many bytes a body is validated inline: the hop to a thread (~0.1 ms) costs more than
# parsing it (~64 KiB of JSON parses in ~0.3 ms), and small bodies are nearly every agent call.
INLINE_BYTES = 64 * 1024
REF = "#/components/schemas/{model}"

M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], raw: bytes) -> M:
    """JSON text to a wire type: the function `read_body` runs inline or on a thread. `json.loads`, not
    pydantic's own parser: that one refuses a lone surrogate escape ("\\ud800") as invalid JSON, where
    the wire types' validators name the field that holds it."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": f"invalid JSON: {e}"}]) from None
    return model.model_validate(data)


async def read_body(request: Request, model: type[M]) -> M:
    """The request's body as `model`; large bodies are parsed and validated off the event loop."""
    raw = await request.body()
    try:
        if len(raw) < INLINE_BYTES:
            return validate(model, raw)
        return await asyncio.to_thread(validate, model, raw)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False, include_context=False)]
        raise RequestValidationError(errors) from None


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
