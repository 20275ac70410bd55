"""The OpenAI-compatible HTTP app: chat and text completions (streaming or not), models, health, metrics.

The event loop only parses and relays. A request is prepared (validated against limits.py,
its constraint compiled and checked, its messages rendered and tokenised) on a preparing thread with a
large stack (offload.py), and the model runs on the app's single worker thread (see worker.py), which
decodes concurrent requests, and the n samples of a request, as rows of one batch (continuous
batching: new requests join between iterations).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine, GenerationResult
from ..errors import ExactSpecError
from ..spec.law import Matcher, Penalties, grammar_from_spec
from ..spec.sampling import SamplingParams
from .body_limit import BodyLimit, unparsable
from .history import for_template
from .limits import MAX_BODY_BYTES, LimitError, check_constraint, check_stops, token_id
from .metrics import Metrics
from .offload import Preparer
from .responses import Shapes, error_body, sse
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from .streaming import StreamedChoice
from .tools import ToolPlan, plan_tools
from .worker import Job, Worker

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
CLIENT_CLOSED = 499  # nginx's status for a client that left before the response was complete
MAX_TOKENS_DEFAULT = 2048  # the token budget of a request without max_tokens (serve --max-tokens-default)


class ApiError(Exception):
    """A request the server refuses: rendered as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def create_app(engine: Engine, model_name: str = "exactspec", max_rows: int = 16,
               max_body_bytes: int = MAX_BODY_BYTES, max_tokens_default: int | None = MAX_TOKENS_DEFAULT) -> FastAPI:
    """An app serving `engine` under `model_name`; it starts its worker thread on startup.
    `max_rows`: samples decoded together in one batch (1: one at a time); `max_body_bytes`: the
    largest request body accepted (413 beyond it, while the body is read); `max_tokens_default`: the
    budget of a request that gives no max_tokens (None: the rest of the context)."""
    metrics = Metrics()
    metrics.watch_prefix_cache(engine)
    worker, preparer = Worker(engine, metrics, max_rows), Preparer()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        preparer.start()
        worker.start()
        yield
        worker.stop()
        preparer.stop()

    app = FastAPI(title="exactspec", summary="exact speculative decoding, OpenAI-compatible", lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.metrics = engine, worker, metrics
    started = int(time.time())

    def refuse(request: Request, error: ApiError) -> JSONResponse:
        if request.url.path in (CHAT, TEXT):
            metrics.observe_request(request.url.path, error.status)
        return JSONResponse(error_body(error.message, error.param, error.code, error.type), status_code=error.status)

    def too_large(path: str) -> tuple[int, bytes]:
        if path in (CHAT, TEXT):
            metrics.observe_request(path, 413)
        body = error_body(f"the request body is larger than {max_body_bytes} bytes", code="request_too_large")
        return 413, json.dumps(body).encode()

    app.add_middleware(BodyLimit, limit=max_body_bytes, refuse=too_large)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return refuse(request, error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return refuse(request, _validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if (message := unparsable(error)) is not None:  # the body is not JSON we can read
            return refuse(request, ApiError(400, message))
        return refuse(request, ApiError(error.status_code, str(error.detail), code=str(error.status_code)))

    def plan(body: GenerationRequest, prompt: str | list[dict], chat_template: bool | None, budget: int | None,
             prompt_param: str, budget_param: str, tools: ToolPlan | None = None) -> list[Job]:
        """Check and tokenise a request (on the preparing thread); one job per sample."""
        sampling = dict(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                        lenience=body.lenience)
        try:
            SamplingParams(**sampling)
            check_stops(body.stop_list())
        except LimitError as e:
            raise ApiError(400, str(e), e.param) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        sampling.update(law_options(body, tools))
        try:
            ids = engine.new_result(prompt, chat_template).prompt_token_ids
        except Exception as e:  # ExactSpecError, or a chat template refusing the messages (jinja2 errors)
            raise ApiError(400, f"cannot encode the prompt: {e}", prompt_param) from None
        context = engine.target.max_length
        if not ids:
            raise ApiError(400, "the prompt is empty", prompt_param)
        if len(ids) >= context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {context} tokens",
                           prompt_param, "context_length_exceeded")
        if budget is not None and budget > context:
            raise ApiError(400, f"{budget_param} is {budget}; this model's context is {context} tokens", budget_param)
        room = context - (len(engine.target.decoder_prompt) if engine.is_encoder_decoder else len(ids))
        options = dict(max_new_tokens=budget or min(room, max_tokens_default or room), stop=body.stop_list(),
                       gamma=body.gamma, **sampling)
        return [Job(GenerationResult("", [], ids, "length"),
                    {**options, "seed": None if body.seed is None else body.seed + i}) for i in range(body.n)]

    def law_options(body: GenerationRequest, tools: ToolPlan | None) -> dict:
        """The request's grammar, bias, penalties and logprobs as `Engine.make_law` keywords, checked:
        the constraint within limits.py's bounds, compiled, and able to match some text."""
        constraint, param = body.response_format, "tools" if tools is not None else "response_format"
        if tools is not None:
            if constraint is not None and constraint.get("type") != "text":
                raise ApiError(400, "give either response_format or tools, not both", "response_format")
            constraint = tools.constraint
        try:
            check_constraint(constraint, param)
            if (grammar := grammar_from_spec(constraint)) is not None:  # a language with no text fails here
                Matcher(engine.grammar_tokenizer(), grammar, engine.target.vocab_size).mask()
            bias = {token_id(key, engine.target.vocab_size): value for key, value in (body.logit_bias or {}).items()}
        except LimitError as e:
            raise ApiError(400, str(e), e.param) from None
        except ExactSpecError as e:
            raise ApiError(400, str(e), param) from None
        try:
            Penalties(bias, body.presence_penalty, body.frequency_penalty, body.repetition_penalty)
        except ValueError as e:
            raise ApiError(400, str(e), "logit_bias") from None
        return dict(grammar=constraint, logit_bias=bias, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                    logprobs=body.logprobs_k())

    def plan_chat(body: ChatCompletionRequest) -> tuple[list[Job], ToolPlan | None]:
        """A chat request's tools, messages (tool history included, see history.py) and jobs."""
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        try:
            tools = plan_tools(body.tools, body.tool_choice)
        except LimitError as e:
            raise ApiError(400, str(e), e.param) from None
        except ExactSpecError as e:
            raise ApiError(400, str(e), "tool_choice" if body.tools else "tools") from None
        messages = for_template(body.chat(), getattr(engine.tokenizer, "chat_template", None))
        if tools is not None:  # show the model its tools in the system message
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools.system_prompt}
            else:
                messages.insert(0, {"role": "system", "content": tools.system_prompt})
        return plan(body, messages, None, body.token_budget(), "messages", param, tools), tools

    def reproducible(body: GenerationRequest) -> bool:
        """Whether the same request with the same seed gives the same text: greedy always; sampled
        only at a fixed γ with a fixed drafter (auto γ and the auto drafter learn across requests and
        price by the batch, so they draft differently, and an exact sampler then draws another sample)."""
        gamma = engine.gamma if body.gamma is None else body.gamma
        return SamplingParams(temperature=body.temperature).greedy or (gamma != "auto" and engine.draft != "auto")

    async def complete(request: Request, body: GenerationRequest, endpoint: str, jobs: list[Job],
                       tools: ToolPlan | None = None) -> Response:
        shapes = Shapes(endpoint == CHAT, model_name, token_text, tools, engine.token_bytes, reproducible(body))
        start = time.perf_counter()
        prompt_tokens = len(jobs[0].result.prompt_token_ids)
        if body.stream:
            return StreamingResponse(stream(shapes, body, endpoint, jobs, start), media_type="text/event-stream")
        metrics.running.inc()
        try:
            completed = await _unless_disconnected(request, run_all(jobs))
        except Exception as e:
            raise _job_error(e) from None  # rendered and counted by the ApiError handler
        finally:
            metrics.running.dec()
        metrics.observe_request(endpoint, 200 if completed else CLIENT_CLOSED, time.perf_counter() - start)
        metrics.observe_prefill(jobs[0].result, engine.prefix_cache is not None)
        if not completed:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(shapes.response(prompt_tokens, [job.result for job in jobs]))

    async def run_all(jobs: list[Job]) -> None:
        async for _ in worker.generate_all(jobs):
            pass

    async def stream(shapes: Shapes, body: GenerationRequest, endpoint: str, jobs: list[Job],
                     start: float) -> AsyncIterator[str]:
        metrics.running.inc()
        status = CLIENT_CLOSED  # until [DONE] is on its way
        try:
            choices = [StreamedChoice(shapes, index) for index in range(len(jobs))]
            for choice in choices:
                for chunk in choice.start():
                    yield sse(chunk)
            async for index, piece in worker.generate_all(jobs):  # the samples' pieces, interleaved
                choice = choices[index]
                for chunk in choice.finish(jobs[index].result) if piece is None else choice.piece(piece):
                    yield sse(chunk)
            if body.include_usage:
                yield sse(shapes.usage_chunk(len(jobs[0].result.prompt_token_ids), [job.result for job in jobs]))
            status = 200
        except Exception as e:  # the response has started: report the error in-band
            error = _job_error(e)
            status = error.status
            yield sse(error_body(error.message, error.param, error.code, error.type))
        finally:
            metrics.running.dec()
            metrics.observe_request(endpoint, status, time.perf_counter() - start)
            metrics.observe_prefill(jobs[0].result, engine.prefix_cache is not None)
        yield sse("[DONE]")

    @app.post(CHAT)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions; `top_k`, `min_p` and `gamma` are extensions."""
        jobs, tools = await preparer.run(plan_chat, body)
        return await complete(request, body, CHAT, jobs, tools)

    @app.post(TEXT)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) text completions: the prompt is fed as raw text, no chat template."""
        jobs = await preparer.run(plan, body, body.text(), False, body.token_budget(), "prompt", "max_tokens")
        return await complete(request, body, TEXT, jobs)

    def token_text(token: int) -> str:
        return engine.tokenizer.decode([token])

    @app.get("/v1/models")
    async def models() -> dict:
        """The one model this server runs, and the budget of a request without max_tokens."""
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": started, "owned_by": "exactspec",
                          "max_tokens_default": max_tokens_default, "exactspec": engine.runtime()}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the worker thread runs; `queued` is the number of samples waiting for it."""
        ok = worker.alive
        return JSONResponse({"status": "ok" if ok else "worker stopped", "model": model_name, "queued": worker.queued},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition of this app's registry."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


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


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Await `work`, cancelling it if the client disconnects first; True if it completed."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False
    task.result()  # re-raises a failed job's exception
    return True


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
