"""The HTTP gateway: OpenAI-compatible routes (Chat Completions, Completions, Responses, Anthropic
Messages), swarm routes, and the handlers that render every refusal (`core.serve.errors`).

A request belongs to an episode through its bearer key (or the path form
`/episodes/{secret}/v1/...`, the secret derived from the key, for clients that cannot set one;
never the bare episode id, see `core.episodes.auth`); its tokens are then recorded on that
episode. Requests without a key are served, unrecorded, only when the server allows anonymous use.
No input a client can send reaches a bare 500: validation, template, context and episode errors all
map to a `Refusal`, rendered in the caller's API's shape. Every API converts to one chat turn (`prepare_chat`, `run_chat`; the
Responses and Messages routes in `core.serve.responses` and `core.serve.messages`), so all record the
same ids for the same conversation. Bodies over `server.max_request_bytes` get 413
(`core.serve.body_limit`); large ones are parsed off the event loop (`core.serve.bodies`);
rendering and tokenizing run off the event loop, after a byte-length check that refuses a prompt
its text alone proves too long; every engine await is bounded by `server.request_timeout_s` (504);
a request the engine could not generate (`GenerationError`) gets its own 500 naming why.
The gateway renders and records; engines generate, the registry keeps books.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.episodes.auth import bearer
from core.serve.body_limit import BodyLimit
from core.serve.bodies import BodyParser, body_schema, openapi_bodies
from core.serve.chat import PromptTooLong, Rendered, TemplateError
from core.engine import Generation, GenerationError, SamplingParams, is_greedy
from core.episodes.errors import Refusal
from core.episodes.keys import KEY_PREFIX
from core.records import Call, Episode
from core.serve.protocol import call_sampling, start_calls
from core.serve.state import Policy, ServerState
from core.serve.messages import MessagesAPI
from core.serve.messages_wire import CountTokensRequest, MessagesRequest
from core.serve.responses import ResponsesAPI
from core.serve.responses_wire import ResponsesRequest
from core.serve.streaming import PreparedChat, stream_chat
from core.serve.swarm_routes import swarm_router
from core.serve.tool_calls import CALL_CLOSE, forced_call
from core.serve.errors import error_response
from core.serve.openai_wire import ChatRequest, CompletionRequest

log = logging.getLogger(__name__)

def build_app(server: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        sweeper = asyncio.create_task(server.sweep_leases())
        yield
        sweeper.cancel()
        gw.bodies.close()

    app = FastAPI(title="swarmrl", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=server.cfg.server.max_request_bytes)
    gw = _Gateway(server)

    # Every refusal, whoever raised it, is rendered by `core.serve.errors` in the shape of the caller's API.
    @app.exception_handler(Refusal)
    async def _refused(request: Request, e: Refusal):
        return error_response(request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") in ("json_invalid", "model_attributes_type", "model_type") and not where:
            msg = "request body must be a JSON object"
        return error_response(request.url.path, Refusal(400, f"{where}: {msg}" if where else msg, "invalid_request",
                                                        param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(request.url.path, Refusal(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(request.url.path, Refusal(500, f"internal error: {type(e).__name__}", "internal_error"))

    @app.get("/v1/models")
    async def list_models():
        now = int(server.throughput.started)
        # max_model_len as vLLM reports it: clients (the researcher's planner) fit requests to the context
        data = [{"id": n, "object": "model", "created": now, "owned_by": "swarmrl", "max_model_len": p.engine.max_context}
                for n, p in server.policies.items()]
        return {"object": "list", "data": data}

    # Each API on two routes, keyed and path form. Bodies are read raw and parsed by `gw.bodies`
    # (large ones off the event loop); `body_schema` keeps them in the OpenAPI document.
    apis = ((ChatRequest, "chat/completions", gw.chat), (CompletionRequest, "completions", gw.complete),
            (ResponsesRequest, "responses", gw.responses.create), (MessagesRequest, "messages", gw.messages.create),
            # exact prompt lengths, rendered as the create routes render (LangChain and Claude-Code-style harnesses ask)
            (ResponsesRequest, "responses/input_tokens", gw.responses.input_tokens),
            (CountTokensRequest, "messages/count_tokens", gw.messages.count_tokens))
    for wire, path, handle in apis:
        keyed, by_path = _routes(gw, wire, handle, x_api_key=path.startswith("messages"))  # the anthropic SDK's header
        app.add_api_route(f"/v1/{path}", keyed, methods=["POST"], openapi_extra=body_schema(wire),
                          name=path.replace("/", "_"))
        app.add_api_route(f"/episodes/{{secret}}/v1/{path}", by_path, methods=["POST"],
                          openapi_extra=body_schema(wire), name=path.replace("/", "_") + "_path")
    openapi_bodies(app, [wire for wire, _, _, in apis])

    @app.get("/episodes/{secret}/v1/models")
    async def list_models_path(secret: str):
        server.registry.by_path(secret)
        return await list_models()

    app.include_router(swarm_router(server), prefix="/swarm/v1")
    return app


def _routes(gw: _Gateway, wire, handle, x_api_key: bool):
    """One API's two route functions: by key (bearer, or x-api-key where asked) and by path secret."""

    async def keyed(request: Request):
        episode = gw.episode_from_key(request, x_api_key)
        return await _answered(request, handle(await gw.bodies.read(request, wire), episode))

    async def by_path(secret: str, request: Request):
        episode = gw.server.registry.by_path(secret)
        return await _answered(request, handle(await gw.bodies.read(request, wire), episode))

    return keyed, by_path


async def _answered(request: Request, handled):
    """A route's answer; an unexpected failure answered here as a logged 500 in the route's shape. Not left
    to the app's handler for `Exception`: Starlette re-raises after it answers, and uvicorn then closes
    the keep-alive connection, so the client's next request on it failed (ECONNRESET)."""
    try:
        return await handled
    except (Refusal, RequestValidationError, StarletteHTTPException):
        raise  # the app's handlers render these, and the connection stays open
    except Exception as e:  # noqa: BLE001 - answered, not raised: see above
        log.exception("unhandled error")
        return error_response(request.url.path, Refusal(500, f"internal error: {type(e).__name__}", "internal_error"))


class _Gateway:
    def __init__(self, server: ServerState):
        self.server = server
        self.responses, self.messages = ResponsesAPI(self), MessagesAPI(self)
        self.bodies = BodyParser(lambda: {n: p.engine.max_context for n, p in server.policies.items()})

    def episode_from_key(self, request: Request, x_api_key: bool = False) -> Episode | None:
        """The episode of the request's key (`Authorization: Bearer`, or `x-api-key` where asked)."""
        key = bearer(request) or (request.headers.get("x-api-key", "").strip() if x_api_key else "")
        if key.startswith(KEY_PREFIX):
            return self.server.registry.by_key(key)
        if not self.server.allow_anonymous:  # off while a trainer runs: nothing unrecorded reaches its engine
            raise Refusal(401, "this server needs an episode key (Authorization: Bearer sk-swarm-...): anonymous "
                           "use is off while it trains", "invalid_api_key")
        return None

    def policy(self, name: str) -> Policy:
        policy = self.server.policies.get(name)
        if policy is None:
            raise Refusal(404, f"model {name!r} is not served here; served: {sorted(self.server.policies)}",
                           "model_not_found")
        return policy

    def sampling(self, body, policy: Policy, prompt_len: int, requested: int | None,
                 episode: Episode | None = None) -> list[SamplingParams]:
        asked = call_sampling(self.server, episode, body, requested)  # the episode protocol: seed, eval sampling
        requested = asked.max_tokens
        room = policy.engine.max_context - prompt_len
        if room < 1:
            raise Refusal(400, f"prompt is {prompt_len} tokens; the model's context is {policy.engine.max_context}",
                           "context_length_exceeded")
        if requested is not None and requested > room:
            raise Refusal(400, f"prompt ({prompt_len}) + max_tokens ({requested}) exceeds the model's context "
                           f"({policy.engine.max_context})", "context_length_exceeded")
        max_tokens = min(requested or self.server.cfg.engine.default_max_tokens, room)
        temperature = self.server.cfg.engine.default_temperature if asked.temperature is None else asked.temperature
        temperature = 0.0 if is_greedy(temperature) else temperature  # every engine sees greedy as 0
        # The calls' indices are reserved before they are sampled: two concurrent calls of one episode get two
        # (and two derived seeds), whichever is recorded first.
        first = self.server.registry.reserve_calls(episode, body.n) if episode is not None else 0
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=asked.top_p, stop=asked.stop,
                           seed=None if body.seed is None else body.seed + i, key=draw_key(episode, first, i))
            for i in range(body.n)
        ]
        start_calls(self.server, episode, len(params))  # last: beyond the sandbox's max_calls, refused and failed
        return params

    async def generate(self, policy: Policy, prompt_ids: list[int], params: list[SamplingParams]) -> list[Generation]:
        """One generation per params, awaited for at most `server.request_timeout_s` (504 after)."""
        timeout = self.server.cfg.server.request_timeout_s
        tasks = [asyncio.ensure_future(policy.engine.generate(prompt_ids, p)) for p in params]
        try:
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout)
        except TimeoutError:
            raise Refusal(504, f"the engine did not answer within server.request_timeout_s ({timeout:g} s)",
                           "timeout") from None
        except GenerationError as e:
            raise Refusal(500, f"generation failed: {e}", "generation_failed") from None
        finally:
            for t in tasks:  # the other choices of a failed request free their rows (a no-op once done)
                t.cancel()

    async def render(self, policy: Policy, messages, tools, history, forced: str = ""):
        """Render and tokenize on a worker thread: a long prompt never stalls the event loop."""
        try:
            return await asyncio.to_thread(policy.renderer.render, messages, tools, history, policy.engine.max_context,
                                           forced)
        except TemplateError as e:
            raise Refusal(400, str(e), "invalid_messages") from None
        except PromptTooLong as e:
            raise Refusal(400, str(e), "context_length_exceeded") from None

    async def encode(self, policy: Policy, text: str) -> list[int]:
        try:
            policy.renderer.check_length(text, policy.engine.max_context)
        except PromptTooLong as e:
            raise Refusal(400, str(e), "context_length_exceeded") from None
        return await asyncio.to_thread(policy.renderer.encode, text)

    def text_of(self, policy: Policy, gen: Generation) -> str:
        text = policy.renderer.completion_text(gen.token_ids)
        if gen.stop_string and gen.stop_string in text:
            text = text[: text.index(gen.stop_string)]
        return text

    def record(self, episode: Episode | None, call: Call) -> None:
        self.server.throughput.calls += 1
        self.server.throughput.completion_tokens += len(call.completion_ids)
        if episode is not None:
            self.server.registry.record(episode, call)

    async def render_turn(self, body: ChatRequest, episode: Episode | None) -> tuple[Policy, Rendered, bool, str]:
        """A chat turn's prompt, exactly as it would be generated from: (policy, rendered, tools offered,
        the reply's forced start). Nothing counted or recorded: `prepare_chat` and the token-count routes share it."""
        policy = self.policy(body.model)
        messages = [m.to_template() for m in body.messages]
        tools_offered = bool(body.tools) and body.tool_choice != "none"
        tools = [t.to_template() for t in body.tools] if tools_offered else None
        forced = forced_call(policy.renderer, body.forced_tool()) if tools_offered else ""
        history = episode.calls_of(policy.name) if episode is not None else []
        return policy, await self.render(policy, messages, tools, history, forced), tools_offered, forced

    async def prepare_chat(self, body: ChatRequest, episode: Episode | None, cap_max_tokens: bool = False) -> PreparedChat:
        """Render a chat turn (token-in-token-out against the episode's calls): what every API runs. With
        `cap_max_tokens` (Messages, whose clients must always send one), a max_tokens past the context is cut to fit."""
        policy, rendered, tools_offered, forced = await self.render_turn(body, episode)
        messages = rendered.messages  # echoed tool calls in canonical text: what later turns match against
        tp = self.server.throughput
        tp.tito_reused += rendered.reused_prefix > 0
        tp.tito_drift += rendered.drift
        tp.tito_broken += rendered.broken
        asked, room = body.max_completion_tokens or body.max_tokens, policy.engine.max_context - len(rendered.prompt_ids)
        capped = asked if cap_max_tokens and asked is not None and 1 <= room < asked else None
        params = self.sampling(body, policy, len(rendered.prompt_ids), room if capped else asked, episode)
        prep = PreparedChat(policy, messages, tools_offered, rendered, params, list(params[0].stop if params else ()))
        return _constrained(prep, forced, capped, one_call=tools_offered and body.parallel_tool_calls is False)

    async def run_chat(self, prep: PreparedChat, episode: Episode | None) -> list[tuple[dict, Generation]]:
        """Generate every choice of a prepared turn, parse and record each: (reply, generation) per choice."""
        gens = await self.generate(prep.policy, prep.rendered.prompt_ids, prep.params)
        out = []
        for gen in gens:
            reply = prep.reply(gen)
            self.record(episode, self.make_call(prep.policy, prep.messages, prep.rendered, gen, reply))
            out.append((reply, gen))
        return out

    async def chat(self, body: ChatRequest, episode: Episode | None):
        prep = await self.prepare_chat(body, episode)
        policy = prep.policy
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_chat(self, prep, include_usage, episode), media_type="text/event-stream")
        choices, completion_tokens = [], 0
        for i, (reply, gen) in enumerate(await self.run_chat(prep, episode)):
            choices.append({
                "index": i,
                "message": reply,
                "finish_reason": "tool_calls" if reply.get("tool_calls") else gen.finish_reason,
                "logprobs": self.logprobs(policy, gen) if body.logprobs else None,
            })
            completion_tokens += len(gen.token_ids)
        return self.envelope("chat.completion", policy, choices, len(prep.rendered.prompt_ids), completion_tokens)

    def make_call(self, policy: Policy, messages, rendered, gen: Generation, reply) -> Call:
        return Call(
            model=policy.name, version=gen.version, messages=messages, prompt_ids=rendered.prompt_ids,
            completion_ids=gen.token_ids, completion_logprobs=gen.logprobs, finish_reason=gen.finish_reason,
            temperature=gen.temperature, top_p=gen.top_p, reused_prefix=rendered.reused_prefix, reply=reply,
        )

    async def complete(self, body: CompletionRequest, episode: Episode | None):
        policy = self.policy(body.model)
        if body.stream:
            raise Refusal(400, "streaming is not offered on /v1/completions (it is on /v1/chat/completions, "
                           "/v1/responses and /v1/messages)", "unsupported")
        if isinstance(body.prompt, str):
            prompt_ids = await self.encode(policy, body.prompt)
        else:
            vocab = len(policy.tokenizer)
            if len(body.prompt) >= policy.engine.max_context:  # before scanning ids: a huge list is refused unread
                raise Refusal(400, f"prompt is {len(body.prompt)} tokens; the model's context is "
                               f"{policy.engine.max_context}", "context_length_exceeded")
            if min(body.prompt) < 0 or max(body.prompt) >= vocab:
                raise Refusal(400, f"prompt token ids must lie in [0, {vocab})", "invalid_prompt")
            prompt_ids = body.prompt
        params = self.sampling(body, policy, len(prompt_ids), body.max_tokens, episode)
        gens = await self.generate(policy, prompt_ids, params)
        choices, completion_tokens = [], 0
        for i, gen in enumerate(gens):
            text = self.text_of(policy, gen)
            self.record(episode, Call(
                model=policy.name, version=gen.version, prompt_ids=prompt_ids, completion_ids=gen.token_ids,
                completion_logprobs=gen.logprobs, finish_reason=gen.finish_reason, temperature=gen.temperature,
                top_p=gen.top_p,
            ))
            prefix = policy.tokenizer.decode(prompt_ids) if body.echo else ""
            lp = None
            if body.logprobs:
                lp = {"tokens": [policy.tokenizer.decode([t]) for t in gen.token_ids], "token_logprobs": gen.logprobs,
                      "top_logprobs": None, "text_offset": None}
            choices.append({"index": i, "text": prefix + text, "finish_reason": gen.finish_reason, "logprobs": lp})
            completion_tokens += len(gen.token_ids)
        return self.envelope("text_completion", policy, choices, len(prompt_ids), completion_tokens)

    def logprobs(self, policy: Policy, gen: Generation) -> dict[str, Any]:
        content = []
        for t, lp in zip(gen.token_ids, gen.logprobs):
            piece = policy.tokenizer.decode([t])
            content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
        return {"content": content}

    def envelope(self, kind: str, policy: Policy, choices: list, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex,
            "object": kind,
            "created": int(time.time()),
            "model": policy.name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": f"swarmrl-v{policy.version}",
        }


def _constrained(prep: PreparedChat, forced: str, capped: int | None, one_call: bool) -> PreparedChat:
    """`prep` with what its request asked of the reply: a forced start (`tool_choice`), max_tokens cut to
    fit (`capped`: the number asked), and at most one call (generation stops at the first call's close)."""
    prep.forced, prep.capped_from, prep.one_call = forced, capped, one_call
    if one_call:
        prep.params = [replace(p, stop=p.stop + (CALL_CLOSE,)) for p in prep.params]
    return prep


def draw_key(episode: Episode | None, call: int, choice: int) -> str | None:
    """A call's sampling key (`SamplingParams.key`): its episode's name across runs (sandbox, task,
    ordinal), the call's index in the episode (reserved by `Registry.reserve_calls` before sampling) and
    the choice. None without an episode."""
    if episode is None:
        return None
    return f"{episode.sandbox}/{episode.task_id}/{episode.ordinal}/{call}/{choice}"
