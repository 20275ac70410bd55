"""The HTTP app: OpenAI chat and text completions, OpenAI Responses and Anthropic Messages (streaming or
not), models, health, metrics. Every API is one front door (doors.py) over the same internal request.

The event loop only parses and relays. A request is translated (translate.py: validated against
limits.py, its constraint compiled once, its messages rendered and tokenised, one job per sample)
on a preparing thread with a large stack (offload.py), and the model runs on the app's single worker
thread (see worker.py), which decodes concurrent requests, and the n samples of a request, as rows
of one batch (continuous batching: new requests join between iterations). The route handlers are
the methods of `Routes`, which tests can call without HTTP; `create_app` wires them into FastAPI.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..errors import ExactSpecError
from . import anthropic_messages, openai_responses
from .api_error import ApiError
from .auth import ApiKey
from .body_limit import BodyLimit, unparsable
from .doors import ChatDoor, Door, check_text, stop_sequence
from .families import tool_format
from .limits import MAX_BODY_BYTES
from .metrics import Metrics
from .offload import Preparer
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from .shapes import Shapes, error_body
from .streaming import StreamedChoice
from .tools import ToolPlan
from .translate import MAX_TOKENS_DEFAULT, plan_chat, plan_text, reproducible
from .worker import Job, Piece, Worker

__all__ = ["CHAT", "CLIENT_CLOSED", "MAX_TOKENS_DEFAULT", "TEXT", "ApiError", "Routes", "create_app"]

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
RESPONSES, MESSAGES = openai_responses.ENDPOINT, anthropic_messages.ENDPOINT
ENDPOINTS = (CHAT, TEXT, RESPONSES, MESSAGES)  # counted by /metrics per endpoint
CLIENT_CLOSED = 499  # nginx's status for a client that left before the response was complete
STOP_S = 0.5  # on SIGTERM, how long the worker's current step may take to end (a prefill chunk)
FIRST_EVENT_S, KEEPALIVE_S = 0.5, 5.0  # a stream starts by then, and shows life this often (a long prefill)
KEEPALIVE = -1  # the index of a keep-alive among a stream's (index, piece) events
SAID = 256  # names the server's once-only log lines remember
T = TypeVar("T")


def create_app(engine: Engine, model_name: str = "exactspec", max_rows: int = 16,
               max_body_bytes: int = MAX_BODY_BYTES, max_tokens_default: int | None = MAX_TOKENS_DEFAULT,
               api_key: str | None = None, responses_store_mb: float = openai_responses.STORE_MB) -> FastAPI:
    """An app serving `engine` under `model_name`; it starts its worker thread on startup.
    `max_rows`: samples decoded together in one batch (1: one at a time); `max_body_bytes`: the
    largest request body accepted (413 beyond it, while the body is read); `max_tokens_default`: the
    budget of a request that gives no max_tokens (None: the rest of the context); `api_key`: the key
    every request but /health must carry (auth.py; None: none); `responses_store_mb`: the most MiB of
    stored Responses (previous_response_id)."""
    metrics = Metrics()
    metrics.watch_prefix_cache(engine)
    routes = Routes(engine, Worker(engine, metrics, max_rows), metrics, model_name, max_tokens_default,
                    openai_responses.ResponseStore(budget_mb=responses_store_mb))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        routes.preparer.start()
        routes.worker.start()
        yield
        routes.worker.stop(STOP_S)  # a running prefill's chunk may outlast it: the process ends all the same
        routes.preparer.stop()
        cache = engine.prefix_cache
        if cache is not None and cache.spill is not None:
            cache.spill.flush()  # snapshots still being written reach the disk before the process ends
        if not routes.worker.alive:
            routes.worker.save_costs()  # T(k) as serving refined it (a quiet machine's): the next start's prices
        print("exactspec: server stopped", file=sys.stderr, flush=True)  # uvicorn then re-raises the signal

    app = FastAPI(title="exactspec", summary="exact speculative decoding, OpenAI-compatible", lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics, app.state.routes = engine, routes.worker, metrics, routes

    def too_large(path: str) -> tuple[int, bytes]:
        error = ApiError(413, f"the request body is larger than {max_body_bytes} bytes", code="request_too_large")
        return 413, json.dumps(routes.error_shape(path, error)).encode()

    def unauthorized(path: str) -> tuple[int, bytes]:
        error = ApiError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                         code="invalid_api_key")
        return 401, json.dumps(routes.error_shape(path, error)).encode()

    app.add_middleware(BodyLimit, limit=max_body_bytes, refuse=too_large)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key, refuse=unauthorized)  # outermost: before the body is read
    app.add_exception_handler(ApiError, routes.api_error)
    app.add_exception_handler(RequestValidationError, routes.invalid)
    app.add_exception_handler(StarletteHTTPException, routes.http_error)
    app.post(CHAT)(routes.chat_completions)
    app.post(TEXT)(routes.completions)
    app.post(RESPONSES)(routes.responses)
    app.post(RESPONSES + "/input_tokens")(routes.response_input_tokens)
    app.get(RESPONSES + "/{response_id}")(routes.stored_response)
    app.delete(RESPONSES + "/{response_id}")(routes.delete_response)
    app.post(MESSAGES)(routes.messages)
    app.post(anthropic_messages.COUNT)(routes.count_message_tokens)
    app.get("/v1/models")(routes.models)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus)
    return app


class Routes:
    """The route handlers of one app, over its engine, worker and metrics (callable without HTTP)."""

    def __init__(self, engine: Engine, worker: Worker, metrics: Metrics, model_name: str = "exactspec",
                 max_tokens_default: int | None = MAX_TOKENS_DEFAULT,
                 store: openai_responses.ResponseStore | None = None) -> None:
        self.engine, self.worker, self.metrics, self.model_name = engine, worker, metrics, model_name
        self.max_tokens_default = max_tokens_default
        self.preparer = Preparer()
        self.store = store or openai_responses.ResponseStore()
        self.started = int(time.time())
        self.said: set[str] = set()

    def say_once(self, what: str, names: list[str]) -> None:
        """One log line per name the server has not named before (a skipped tool type, an ignored field); the
        names are clients' strings, so at most SAID of them are remembered (and logged)."""
        if new := [n[:80] for n in dict.fromkeys(names) if n[:80] not in self.said][:SAID - len(self.said)]:
            self.said.update(new)
            print(f"exactspec: {what}: {', '.join(new)}", file=sys.stderr, flush=True)

    def say_approximated(self, tools) -> None:
        if tools is not None and tools.approximated:
            self.say_once("tools whose oneOf the grammar holds as anyOf (alternatives may overlap)", tools.approximated)

    # --- errors --------------------------------------------------------------------------------
    def error_shape(self, path: str, error: ApiError) -> dict:
        """The error object of the API at `path` (counted by /metrics for an endpoint)."""
        if path in ENDPOINTS:
            self.metrics.observe_request(path, error.status)
        if path.startswith(MESSAGES):
            return anthropic_messages.error_body(error.status, error.message)
        return error_body(error.message, error.param, error.code, error.type)

    def refuse(self, request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(self.error_shape(request.url.path, error), status_code=error.status)

    async def api_error(self, request: Request, error: ApiError) -> JSONResponse:
        if error.code == "context_length_exceeded":  # said once: an agent CLI's first prompt is 9-22k tokens
            self.say_once(f"a prompt did not fit the {self.engine.target.max_length}-token context (coding-agent "
                          "CLIs need --ctx-size 32768, YaRN past the training context, or `exactspec launch`)",
                          ["docs/server.md, Coding-agent CLIs"])
        return self.refuse(request, error)

    async def invalid(self, request: Request, error: RequestValidationError) -> JSONResponse:
        return self.refuse(request, _validation_error(error))

    async def http_error(self, request: Request, error: StarletteHTTPException) -> JSONResponse:
        if (message := unparsable(error)) is not None:  # the body is not JSON we can read
            return self.refuse(request, ApiError(400, message))
        return self.refuse(request, ApiError(error.status_code, str(error.detail), code=str(error.status_code)))

    # --- completions ---------------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions; `top_k`, `min_p` and `gamma` are extensions."""
        jobs, tools = await self.preparer.run(plan_chat, self.engine, body, self.max_tokens_default)
        self.say_approximated(tools)
        return await self.complete(request, body, CHAT, jobs, tools)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) text completions: the prompt is fed as raw text, no chat template."""
        jobs = await self.preparer.run(plan_text, self.engine, body, self.max_tokens_default)
        return await self.complete(request, body, TEXT, jobs)

    async def responses(self, body: dict, request: Request) -> Response:
        """OpenAI Responses (openai_responses.py): one translator, the chat request, behind it."""
        # off the event loop: a stored conversation's copy and a long body's scan take time
        chat, conversation, tools = await self.preparer.run(_checked_chat, body, self.store)
        self.say_once("tools this server does not run, left out of the prompt", tools.skipped)
        door = openai_responses.ResponsesDoor(body, conversation, self.store, self.model_name, tools)
        return await self.through(request, chat, RESPONSES, door)

    async def response_input_tokens(self, body: dict) -> dict:
        """The tokens a Responses request's prompt would have."""
        chat, _, _ = await self.preparer.run(openai_responses.to_chat, {**body, "stream": False}, self.store)
        return {"object": "response.input_tokens", "input_tokens": await self.count(chat, RESPONSES)}

    async def stored_response(self, response_id: str) -> dict:
        return (await self.preparer.run(self.store.get, response_id))[0]

    async def delete_response(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def messages(self, body: dict, request: Request) -> Response:
        """Anthropic Messages (anthropic_messages.py): one translator, the chat request, behind it."""
        check_text(body)
        chat = anthropic_messages.to_chat(body)
        stops, tokenizer = chat.get("stop"), self.engine.tokenizer
        stops = [stops] if isinstance(stops, str) else stops or []
        eos = self.engine.target.eos_token_ids
        door = anthropic_messages.MessagesDoor(self.model_name,
                                               lambda r: stop_sequence(r, stops, eos, tokenizer.decode))
        return await self.through(request, chat, MESSAGES, door)

    async def count_message_tokens(self, body: dict) -> dict:
        return {"input_tokens": await self.count(anthropic_messages.to_chat(body, counting=True), MESSAGES)}

    async def through(self, request: Request, chat: dict, endpoint: str, door: Door) -> Response:
        """A front door's request as the chat request it translates to, answered in the door's shapes."""
        body = chat_request(chat, endpoint)
        jobs, tools = await self.preparer.run(plan_chat, self.engine, body, self.max_tokens_default)
        self.say_approximated(tools)
        return await self.complete(request, body, endpoint, jobs, tools, door)

    async def count(self, chat: dict, endpoint: str) -> int:
        body = chat_request({**chat, "stream": False}, endpoint)
        jobs, _ = await self.preparer.run(plan_chat, self.engine, body, self.max_tokens_default)
        return len(jobs[0].result.prompt_token_ids)

    async def complete(self, request: Request, body: GenerationRequest, endpoint: str, jobs: list[Job],
                       tools: ToolPlan | None = None, door: Door | None = None) -> Response:
        """Run a translated request: its response, streamed or whole, in `door`'s shapes (chat's by default)."""
        door = door or ChatDoor(body.include_usage)
        engine, metrics = self.engine, self.metrics
        shapes = Shapes(endpoint != TEXT, self.model_name, self.token_text, tools, engine.token_bytes,
                        reproducible(engine, body), engine.runtime()["identity"])
        start = time.perf_counter()
        prompt_tokens = len(jobs[0].result.prompt_token_ids)
        if body.stream:
            return await self.start_stream(request, shapes, door, endpoint, jobs, start)
        metrics.running.inc()
        try:
            completed, _ = await _unless_disconnected(request, self.run_all(jobs))
        except Exception as e:
            raise _job_error(e) from None  # rendered and counted by the ApiError handler
        finally:
            metrics.running.dec()
        metrics.observe_request(endpoint, 200 if completed else CLIENT_CLOSED, time.perf_counter() - start)
        metrics.observe_prefill(jobs[0].result, engine.prefix_cache is not None)
        if not completed:
            return Response(status_code=CLIENT_CLOSED)
        results = [job.result for job in jobs]
        return JSONResponse(door.whole(shapes.response(prompt_tokens, results), results))

    async def run_all(self, jobs: list[Job]) -> None:
        async for _ in self.worker.generate_all(jobs, pieces=False):
            pass

    async def start_stream(self, request: Request, shapes: Shapes, door: Door, endpoint: str,
                           jobs: list[Job], start: float) -> Response:
        """The streamed response, begun once the worker's first event is in, or after FIRST_EVENT_S (a long
        prefill: then keep-alives every KEEPALIVE_S until the first token). An error in that first half
        second (the first step's: a grammar llguidance rejects on its first token) is a 4xx like the
        non-streamed request's; after it, the stream has begun and the error comes in-band."""
        events = _paced(self.worker.generate_all(jobs), FIRST_EVENT_S, KEEPALIVE_S)
        self.metrics.running.inc()
        try:  # the first step's error, if it comes within FIRST_EVENT_S, is a 4xx like a whole request's
            completed, first = await _unless_disconnected(request, anext(events))
        except Exception as e:
            raise _job_error(e) from None  # rendered and counted by the ApiError handler
        finally:
            self.metrics.running.dec()
        if not completed:
            await events.aclose()
            self.metrics.observe_request(endpoint, CLIENT_CLOSED, time.perf_counter() - start)
            return Response(status_code=CLIENT_CLOSED)
        return StreamingResponse(self.stream(shapes, door, endpoint, jobs, start, _resumed(first, events)),
                                 media_type="text/event-stream")

    async def stream(self, shapes: Shapes, door: Door, endpoint: str, jobs: list[Job],
                     start: float, events: AsyncIterator[tuple[int, Piece | None]]) -> AsyncIterator[str]:
        """Server-sent events in `door`'s shapes: every sample's chunks as they come (`events`: the
        worker's, for `jobs`), errors in-band, then the door's closing events."""
        self.metrics.running.inc()
        status = CLIENT_CLOSED  # until the closing events are on their way
        try:
            for text in door.opening(len(jobs[0].result.prompt_token_ids)):
                yield text
            choices = [StreamedChoice(shapes, index) for index in range(len(jobs))]
            for choice in choices:
                for chunk in choice.start():
                    for text in door.chunk(chunk):
                        yield text
            async for index, piece in events:  # the samples' pieces, interleaved
                if index == KEEPALIVE:  # a long prefill: the API's own sign of life
                    for text in door.keepalive():
                        yield text
                    continue
                choice = choices[index]
                for chunk in choice.finish(jobs[index].result) if piece is None else choice.piece(piece):
                    for text in door.chunk(chunk):
                        yield text
            results = [job.result for job in jobs]
            closing = door.closing(shapes.usage_chunk(len(results[0].prompt_token_ids), results), results)
            status = 200
        except Exception as e:  # the response has started: report the error in-band
            error = _job_error(e)
            status = error.status
            closing = door.failure(error)
        finally:
            self.metrics.running.dec()
            self.metrics.observe_request(endpoint, status, time.perf_counter() - start)
            self.metrics.observe_prefill(jobs[0].result, self.engine.prefix_cache is not None)
        for text in closing:
            yield text

    def token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    # --- the rest ------------------------------------------------------------------------------
    async def models(self) -> dict:
        """The one model this server runs, the budget of a request without max_tokens, how it is shown
        tools (`exactspec.tool_format`: a tool family of its chat template, or "generic"; families.py) and
        its context per row (`exactspec.context`: what an agent CLI may fill; `exactspec launch`)."""
        runtime = {**self.engine.runtime(), "tool_format": tool_format(getattr(self.engine.tokenizer, "chat_template", None)),
                   "context": self.engine.target.max_length}
        return {"object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": self.started, "owned_by": "exactspec",
                          "max_tokens_default": self.max_tokens_default, "exactspec": runtime}]}

    async def health(self) -> JSONResponse:
        """200 while the worker thread runs; `queued` is the number of samples waiting for it."""
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "worker stopped", "model": self.model_name,
                             "queued": self.worker.queued}, status_code=200 if ok else 503)

    async def prometheus(self) -> Response:
        """Prometheus text exposition of this app's registry."""
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


RENAMED = {RESPONSES: {"max_tokens": "max_output_tokens", "messages": "input"}}  # chat's name -> the door's


def _checked_chat(body: dict, store: openai_responses.ResponseStore):
    """A Responses body checked for lone surrogates, then translated (openai_responses.to_chat)."""
    check_text(body)
    return openai_responses.to_chat(body, store)


def chat_request(chat: dict, endpoint: str) -> ChatCompletionRequest:
    """A front door's translation, checked as a chat request: a field it got wrong is a 400 naming it
    by the door's name for it."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first["loc"]]
        if loc:
            loc[0] = RENAMED.get(endpoint, {}).get(loc[0], loc[0])
        where = ".".join(loc)
        raise ApiError(400, f"{where}: {first['msg']}", where or None) from None


def _validation_error(error: RequestValidationError) -> ApiError:
    """FastAPI's first validation problem as an OpenAI-style 400."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [str(part) for part in first["loc"][1:]]  # drop "body"
    where = ".".join(loc)
    return ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], loc[0] if loc else None)


def _job_error(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ExactSpecError):
        return ApiError(400, str(e))
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", type_="server_error")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Await `work`, cancelling it if the client disconnects first: (True, its result) if it completed,
    (False, None) if not."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False, None
    return True, task.result()  # re-raises a failed job's exception


async def _paced(events: AsyncGenerator[T, None], first_s: float, every_s: float) -> AsyncGenerator[T, None]:
    """`events`, with (KEEPALIVE, None) in between: after `first_s` without the first one, then after each
    `every_s` without the next (a long prefill's stream starts and shows signs of life)."""
    pending, wait_s = None, first_s
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=wait_s)
            wait_s = every_s
            if not done:
                yield KEEPALIVE, None
                continue
            pending, finished = None, pending
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the generator is running inside it: cancelled and awaited before it is closed
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()


async def _resumed(first: T, rest: AsyncGenerator[T, None]) -> AsyncIterator[T]:
    """`first`, then the rest of the generator it came from (closed when this one is)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
