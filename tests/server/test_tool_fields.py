"""Malformed tool fields (issue 40): every bad `tools` / `tool_choice` / tool-history shape is a 400 that
names the field, streamed or not, never a 500; in `exactspec batch` such a line fails alone."""

from __future__ import annotations

import json

import httpx
import pytest

from exactspec.scale.batch import run_lines
from exactspec.server import create_app
from exactspec.server.schemas import ChatCompletionRequest
from exactspec.server.translate import ApiError, plan_chat

from ..helpers.servers import MODEL, _running

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


def fn(**function) -> list[dict]:
    return [{"type": "function", "function": function}]


def assistant_call(call) -> list[dict]:
    return [*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


# (request fields, the param the 400 names -- or, for pydantic's checks, a fragment of it)
MALFORMED = [
    # tool_choice
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice.function"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": ["x"]}}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["x"]}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": {"a": 1}}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": None}}, "tool_choice.function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": ["auto"]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    # tools
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [1]}, "tools"),
    ({"tools": [None]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": "get_weather"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools[0]"),
    ({"tools": [{"function": WEATHER["function"]}]}, "tools[0]"),
    ({"tools": fn(name=5)}, "tools[0].function.name"),
    ({"tools": fn(name=["get_weather"])}, "tools[0].function.name"),
    ({"tools": fn(name="")}, "tools[0].function.name"),
    ({"tools": fn(name='a"b\n')}, "tools[0].function.name"),
    ({"tools": fn(name="x" * 65)}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": fn(name="f", description=7)}, "tools[0].function.description"),
    ({"tools": fn(name="f", parameters=[])}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters="object")}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters=None)}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters={"type": "object", "properties": []})}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters={"type": 5})}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters={"$ref": 5})}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters={"type": "object", "required": "a"})}, "tools[0].function.parameters"),
    ({"tools": [WEATHER] + fn(name="g", parameters={"type": "strin"}), "tool_choice": "none"},
     "tools[1].function.parameters"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    # tool history
    ({"messages": assistant_call("get_weather")}, "messages"),
    ({"messages": assistant_call({"id": 1, "type": "function", "function": {"name": "f", "arguments": "{}"}})},
     "messages"),
    ({"messages": assistant_call({"id": "c1", "type": "function", "function": {"name": "f"}})}, "messages"),
    ({"messages": assistant_call({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}})},
     "messages"),
    ({"messages": assistant_call({"id": "c1", "type": "code", "function": {"name": "f", "arguments": "{}"}})},
     "messages"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": "get_weather"}]}, "messages"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": 5, "content": "ok"}]}, "messages"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c1"}]}, "messages"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c1", "content": {"temp": 22}}]}, "messages"),
]


def _body(fields: dict, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, "stream": stream, **fields}


def _translated(engine, fields: dict) -> ApiError:
    """The ApiError the translator answers (pydantic's checks first, as FastAPI runs them)."""
    from pydantic import ValidationError

    try:
        body = ChatCompletionRequest.model_validate(_body(fields))
    except ValidationError as e:
        return ApiError(400, str(e), str(e.errors()[0]["loc"][0]))
    with pytest.raises(ApiError) as e:
        plan_chat(engine, body)
    return e.value


@pytest.mark.parametrize("fields,param", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_tool_field_is_an_api_error_naming_it(embedded, fields, param):
    error = _translated(embedded, fields)
    assert error.status == 400 and param.split(".")[0].split("[")[0] in (error.param or "")
    if error.param and "." in param:
        assert error.param == param, error.message


@pytest.fixture(scope="module")
def api(embedded):
    yield from _running(create_app(embedded, model_name=MODEL), None)


@pytest.mark.parametrize("stream", [False, True])
def test_no_malformed_tool_field_is_ever_a_500(api, stream):
    """Every shape over HTTP, streamed and not: a 400 whose error object names the field."""
    with httpx.Client(base_url=api.base, timeout=60) as client:
        for fields, param in MALFORMED:
            r = client.post("/v1/chat/completions", json=_body(fields, stream))
            assert r.status_code == 400, (fields, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert param.split(".")[0].split("[")[0] in (error["param"] or ""), (fields, error)
        assert client.get("/health").json()["status"] == "ok"


def test_a_malformed_tool_line_fails_alone_in_batch(embedded):
    good = {"id": "good", "messages": USER, "max_tokens": 2, "temperature": 0}
    lines = [json.dumps({"id": i, **_body(fields)} | {"stream": False}) for i, (fields, _) in enumerate(MALFORMED)]
    out = run_lines(embedded, list(enumerate([json.dumps(good), *lines], 1)), 2)
    assert "error" not in out[0] and out[0]["finish_reason"] in ("stop", "length"), out[0]
    for (fields, param), line in zip(MALFORMED, out[1:]):
        assert "error" in line and param.split(".")[0].split("[")[0] in line["error"], (fields, line)
