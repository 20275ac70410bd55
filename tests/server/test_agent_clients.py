"""Agent frameworks against `exactspec serve`: the OpenAI Agents SDK, LangChain (`bind_tools`,
`with_structured_output`) and pydantic-ai each drive a real multi-step tool loop -- the model calls a
tool, the framework runs a Python function and sends its result back as a `role: tool` message, the
model answers -- over HTTP against a real in-process server on the embedded SmolLM2 (llama.cpp).

The model is tiny, so the first step forces the call (`tool_choice` "required" or a named tool, greedy)
and the last one lets it answer (`tool_choice` "none", or no tools left): the tests check the protocol
-- a call to a listed tool with arguments valid under its schema, the function run on them, its result
sent back under the call's id, a text answer (or a validated object) at the end -- never what the
model says. Every request the frameworks send is recorded at the ASGI layer (no mocks), and the tests
refuse any connection that is not to the local server: no tracing, no telemetry, no internet.

The frameworks are imported inside the tests: together they add seconds to a collection of the suite.
"""

from __future__ import annotations

import json
import socket
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from exactspec.server import create_app

from ..helpers.servers import _running

MODEL = "smol-agents"
QUESTION = "What is the weather in Paris?"
CITIES = ["Paris", "London", "Rome"]
FORECASTS = {"Paris": "sunny, 21 C", "London": "rain, 14 C", "Rome": "clear, 25 C"}


class Forecast(BaseModel):
    """Structured output: short fields, so a few tokens finish the object."""

    city: Literal["Paris", "London", "Rome"]
    sunny: bool


class Recorder:
    """The app, recording the JSON body of every HTTP request it gets (what the frameworks send)."""

    def __init__(self, app) -> None:
        self.app, self.state, self.bodies = app, app.state, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def recorded():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body") and scope["path"].startswith("/v1/"):
                    self.bodies.append(json.loads(b"".join(chunks) or b"null"))
            return message

        return await self.app(scope, recorded, send)

    def take(self) -> list[dict]:
        bodies, self.bodies = self.bodies, []
        return bodies


@pytest.fixture(scope="module")
def api(embedded_llamacpp):
    recorder = Recorder(create_app(embedded_llamacpp, model_name=MODEL))
    for served in _running(recorder, None):
        served.recorder = recorder
        yield served


@pytest.fixture(autouse=True)
def offline(monkeypatch, api):
    """Only the local server may be reached: framework tracing off, and any other connection refused
    (and remembered, so one tried from a background thread fails the test too)."""
    for var, value in {"LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false", "LANGSMITH_API_KEY": "",
                       "OPENAI_AGENTS_DISABLE_TRACING": "1", "OPENAI_API_KEY": "unused",
                       "LOGFIRE_SEND_TO_LOGFIRE": "false"}.items():
        monkeypatch.setenv(var, value)
    refused: list = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def local_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            refused.append(address)
            raise OSError(f"test_agent_clients: no connections but to the local server, not {address}")
        return connect(sock, address)

    def local_getaddrinfo(host, *args, **kwargs):
        if host not in ("127.0.0.1", "::1", "localhost", None):
            refused.append(host)
            raise socket.gaierror(f"test_agent_clients: no name look-ups, not {host!r}")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", local_connect)
    monkeypatch.setattr(socket, "getaddrinfo", local_getaddrinfo)
    api.recorder.take()
    yield
    assert not refused, f"a framework tried to reach {refused}"


def forecast(city: Literal["Paris", "London", "Rome"]) -> str:
    """Get today's weather forecast for a city."""
    return FORECASTS[city]


NAMED = {"type": "function", "function": {"name": "get_forecast"}}


def check_loop(bodies: list[dict], tool: str, ran: list[dict], *first_choices) -> None:
    """The protocol of one tool loop, as the server saw it: the first request forced a call to `tool`
    (its `tool_choice` one of `first_choices`); the next request carries the one call the model made --
    arguments valid under the schema the framework sent, and what the function ran on -- and the
    function's result under the call's id."""
    first, *rest = [b for b in bodies if "messages" in b]
    assert first["tool_choice"] in first_choices, first
    schema = next(t["function"]["parameters"] for t in first["tools"] if t["function"]["name"] == tool)
    assert rest, "the framework never sent the tool's result back"
    history = rest[0]["messages"]
    calls = [m for m in history if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(calls) == 1 and len(calls[0]["tool_calls"]) == 1, history
    call = calls[0]["tool_calls"][0]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == tool
    jsonschema.validate(arguments, schema)
    assert ran == [arguments]
    results = [m for m in history if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [(call["id"], FORECASTS[arguments["city"]])]


def test_langchain_bind_tools_loop(api):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran: list[dict] = []

    @tool
    def get_forecast(city: Literal["Paris", "London", "Rome"]) -> str:
        """Get today's weather forecast for a city."""
        ran.append({"city": city})
        return forecast(city)

    llm = ChatOpenAI(base_url=f"{api.base}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=32,
                     max_retries=0, timeout=60)
    messages = [HumanMessage(QUESTION)]
    # strict: the arguments' object is closed, so a tiny model cannot run on into keys of its own
    step = llm.bind_tools([get_forecast], tool_choice="required", strict=True).invoke(messages)
    assert isinstance(step, AIMessage) and step.response_metadata["finish_reason"] == "tool_calls", step
    assert [c["name"] for c in step.tool_calls] == ["get_forecast"] and not step.invalid_tool_calls
    messages.append(step)
    for call in step.tool_calls:  # LangChain runs the tool: a ToolMessage under the call's id
        result = get_forecast.invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
        messages.append(result)
    answer = llm.bind_tools([get_forecast], tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls, answer
    check_loop(api.recorder.take(), "get_forecast", ran, "required")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(api, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{api.base}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=32,
                     max_retries=0, timeout=60)
    # strict: the schema closes the object (additionalProperties false), so the model cannot run on into
    # properties of its own (a named call's arguments are any JSON object the schema allows)
    out = llm.with_structured_output(Forecast, method=method, strict=True, include_raw=True).invoke(
        "Is it sunny in Paris today?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Forecast), out
    (body,) = api.recorder.take()
    if method == "json_schema":
        assert body["response_format"]["type"] == "json_schema"
    else:  # a forced call to a tool named after the model, read back as the object
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Forecast"}}
        assert [c["name"] for c in out["raw"].tool_calls] == ["Forecast"]


def pydantic_agent(api, then, **agent_kwargs):
    """A pydantic-ai Agent on our server with the `get_forecast` tool, whose first step must call it and
    whose later steps get `then` as tool_choice (pydantic-ai's way to vary it per step) -> (agent, the
    calls the tool ran)."""
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class ForecastFirst(AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["get_forecast"] if ctx.run_step <= 1 else then}

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{api.base}/v1", api_key="unused"))
    agent = Agent(model, model_settings={"max_tokens": 32, "temperature": 0}, capabilities=[ForecastFirst()],
                  **agent_kwargs)
    ran: list[dict] = []

    @agent.tool_plain
    def get_forecast(city: Literal["Paris", "London", "Rome"]) -> str:
        """Get today's weather forecast for a city."""
        ran.append({"city": city})
        return forecast(city)

    return agent, ran


def test_pydantic_ai_agent_tool_loop(api):
    """The first step calls the tool; after it the model answers in text."""
    from pydantic_ai.messages import TextPart, ToolCallPart, ToolReturnPart

    agent, ran = pydantic_agent(api, "none")
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, str) and result.output
    parts = [type(p) for m in result.all_messages() for p in m.parts]
    assert parts.count(ToolCallPart) == 1 and parts.count(ToolReturnPart) == 1 and parts[-1] is TextPart, parts
    # a one-tool list goes out as "required" or as the named tool: both force this call
    check_loop(api.recorder.take(), "get_forecast", ran, "required", NAMED)


def test_pydantic_ai_agent_structured_output(api):
    """A tool step, then the run ends in a validated object: pydantic-ai's output tool, forced."""
    agent, ran = pydantic_agent(api, ["final_result"], output_type=Forecast)
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, Forecast)
    bodies = api.recorder.take()
    check_loop(bodies, "get_forecast", ran, NAMED)
    assert bodies[-1]["tool_choice"] == {"type": "function", "function": {"name": "final_result"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_agents_sdk_tool_loop(api, stream):
    import asyncio

    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran: list[dict] = []

    # One call: the tool is offered until it has run, so the next step answers in text (the Agents SDK
    # resets tool_choice after a call, to "auto", where this tiny model would call it again).
    @function_tool(is_enabled=lambda ctx, agent: not ran)
    def get_forecast(city: Literal["Paris", "London", "Rome"]) -> str:
        """Get today's weather forecast for a city."""
        ran.append({"city": city})
        return forecast(city)

    client = AsyncOpenAI(base_url=f"{api.base}/v1", api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="forecaster", instructions="Answer in one sentence.", tools=[get_forecast],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=32, temperature=0))
    if stream:  # the calls arrive as streamed tool_call deltas, the answer as content deltas
        async def streamed():
            run = Runner.run_streamed(agent, QUESTION, max_turns=3)
            events = [event.type async for event in run.stream_events()]
            assert "raw_response_event" in events and "run_item_stream_event" in events, set(events)
            return run

        result = asyncio.run(streamed())
    else:
        result = Runner.run_sync(agent, QUESTION, max_turns=3)
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    bodies = api.recorder.take()
    assert len(bodies) == 2 and not bodies[1].get("tools") and all(b.get("stream", False) == stream for b in bodies)
    check_loop(bodies, "get_forecast", ran, "required")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_agents_sdk_default_responses_model_tool_loop(api, stream):
    """The Agents SDK's default model speaks the Responses API: the call arrives as a function_call
    item, its result goes back as a function_call_output item under the call's id."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran: list[dict] = []

    @function_tool(is_enabled=lambda ctx, agent: not ran)
    def get_forecast(city: Literal["Paris", "London", "Rome"]) -> str:
        """Get today's weather forecast for a city."""
        ran.append({"city": city})
        return forecast(city)

    client = AsyncOpenAI(base_url=f"{api.base}/v1", api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="forecaster", instructions="Answer in one sentence.", tools=[get_forecast],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=32, temperature=0))
    if stream:
        async def streamed():
            run = Runner.run_streamed(agent, QUESTION, max_turns=3)
            [event async for event in run.stream_events()]
            return run

        result = asyncio.run(streamed())
    else:
        result = Runner.run_sync(agent, QUESTION, max_turns=3)
    assert isinstance(result.final_output, str) and result.final_output
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    first, second = api.recorder.take()
    assert first["tool_choice"] == "required" and first["instructions"] == "Answer in one sentence."
    schema = next(t["parameters"] for t in first["tools"] if t["name"] == "get_forecast")
    call = next(i for i in second["input"] if i.get("type") == "function_call")
    jsonschema.validate(json.loads(call["arguments"]), schema)
    assert ran == [json.loads(call["arguments"])]
    output = next(i for i in second["input"] if i.get("type") == "function_call_output")
    assert output["call_id"] == call["call_id"] and output["output"] == FORECASTS[ran[0]["city"]]


def test_langchain_anthropic_tool_loop(api):
    """LangChain's Anthropic chat model on /v1/messages: a tool_use, LangChain runs the tool, its
    tool_result goes back, a text answer."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    ran: list[dict] = []

    @tool
    def get_forecast(city: Literal["Paris", "London", "Rome"]) -> str:
        """Get today's weather forecast for a city."""
        ran.append({"city": city})
        return forecast(city)

    llm = ChatAnthropic(base_url=api.base, api_key="unused", model=MODEL, temperature=0, max_tokens=32,
                        max_retries=0, timeout=60)
    messages = [HumanMessage(QUESTION)]
    # the tool's schema closed (additionalProperties false), so a tiny model cannot run on into keys of its own
    closed = {"name": "get_forecast", "description": get_forecast.description,
              "input_schema": {**get_forecast.tool_call_schema.model_json_schema(), "additionalProperties": False}}
    step = llm.bind_tools([closed], tool_choice="any").invoke(messages)
    assert isinstance(step, AIMessage) and step.response_metadata["stop_reason"] == "tool_use", step
    assert [c["name"] for c in step.tool_calls] == ["get_forecast"]
    messages.append(step)
    for call in step.tool_calls:
        result = get_forecast.invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
        messages.append(result)
    answer = llm.invoke(messages)
    assert answer.text and not answer.tool_calls, answer
    first, second = api.recorder.take()
    assert first["tool_choice"]["type"] == "any" and ran == [step.tool_calls[0]["args"]]
    results = [b for m in second["messages"] if isinstance(m["content"], list) for b in m["content"]
               if b["type"] == "tool_result"]
    assert [r["tool_use_id"] for r in results] == [step.tool_calls[0]["id"]]
