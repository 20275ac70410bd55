"""Structured output through the server with the official `openai` client: parse() into a pydantic
model, tool calls (named / required / auto, streamed and not; streaming in detail: test_server_stream.py), logprobs equal to the non-speculative
run's, penalties, and the 4xx answers to bad constraints -- all before any generation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from pydantic import BaseModel, Field

from exactspec.server import create_app

from ..helpers.servers import MODEL, _running, metric
from ..helpers.servers import TIME, WEATHER, WEATHER_PROMPT

CHAT = "/v1/chat/completions"
PERSON_PROMPT = [{"role": "user", "content": "Alice is 30 years old. Return her as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int


@pytest.fixture(scope="module")
def api(llamacpp_rows):
    refs = SimpleNamespace(plain=llamacpp_rows.generate(PERSON_PROMPT, max_new_tokens=8, temperature=0, gamma=0,
                                                   logprobs=2))
    yield from _running(create_app(llamacpp_rows, model_name=MODEL), refs)


def test_parse_into_pydantic(api):
    forced_before = metric(api.base, "exactspec_forced_tokens_total")
    completion = api.client.chat.completions.parse(model=MODEL, messages=PERSON_PROMPT, response_format=Person,
                                                   max_tokens=40, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person)
    assert completion.model_extra["speculative"]["forced"] > 0
    assert metric(api.base, "exactspec_forced_tokens_total") > forced_before


def test_json_object_and_length(api):
    ok = [{"role": "user", "content": 'Return a JSON object with one key "ok" set to true.'}]
    resp = api.client.chat.completions.create(model=MODEL, messages=ok, max_tokens=20, temperature=0,
                                              response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop" and isinstance(json.loads(resp.choices[0].message.content), dict)
    short = api.client.chat.completions.create(model=MODEL, messages=PERSON_PROMPT, max_tokens=3, temperature=0,
                                               response_format={"type": "json_object"})
    assert short.choices[0].finish_reason == "length"  # never incomplete JSON claimed as complete


def test_regex_extension(api):
    resp = api.client.completions.create(model=MODEL, prompt="The year is", max_tokens=8, temperature=0,
                                         extra_body={"response_format": {"type": "regex", "regex": " [0-9]{4}"}})
    assert resp.choices[0].finish_reason == "stop"
    assert len(resp.choices[0].text) == 5 and resp.choices[0].text[1:].isdigit()


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_call(api, stream):
    kwargs = dict(model=MODEL, messages=WEATHER_PROMPT, tools=[WEATHER, TIME], max_tokens=40, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        choice = api.client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
        assert choice.message.content is None
    else:
        chunks = list(api.client.chat.completions.create(stream=True, **kwargs))
        deltas = [c for ch in chunks for choice in ch.choices for c in (choice.delta.tool_calls or [])]
        calls = deltas[:1]  # the call's header, then its arguments as fragments (tests/server/test_server_stream.py)
        calls[0].function.arguments = "".join(d.function.arguments for d in deltas)
        finish = [choice.finish_reason for ch in chunks for choice in ch.choices if choice.finish_reason][0]
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_required_and_auto_tool_choice(api, choice):
    resp = api.client.chat.completions.create(model=MODEL, messages=WEATHER_PROMPT, tools=[WEATHER, TIME],
                                              tool_choice=choice, max_tokens=40, temperature=0)
    c = resp.choices[0]
    if choice == "required" or c.message.tool_calls:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name in ("get_weather", "get_time")
        json.loads(c.message.tool_calls[0].function.arguments)
    else:  # auto may answer in text
        assert c.message.content and not c.message.content.startswith("<tool_call>")


def test_logprobs_equal_plain_run(api):
    ref = api.refs.plain
    resp = api.client.chat.completions.create(model=MODEL, messages=PERSON_PROMPT, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=2, extra_body={"gamma": 4})
    content = resp.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == len(ref.logprobs)
    for got, want in zip(content, ref.logprobs):
        assert got.logprob == pytest.approx(want["logprob"], abs=1e-3)
        assert len(got.top_logprobs) == 2
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp for _, lp in want["top"]], abs=1e-3)
    text = api.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                         temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


def test_penalties_and_bias_change_output(api):
    base = dict(model=MODEL, messages=PERSON_PROMPT, max_tokens=6, temperature=0)
    plain = api.client.chat.completions.create(**base).choices[0].message.content
    biased = api.client.chat.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0,
                                                extra_body={"repetition_penalty": 1.5}).choices[0].message.content
    assert biased != plain or len(plain) == 0


@pytest.mark.parametrize("body,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "if": {"type": "object"}}}}}, "Unimplemented"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "type"),
    ({"response_format": {"type": "regex", "regex": "(ab"}}, "regex"),
    ({"response_format": {"type": "grammar", "grammar": "start: x y"}}, "grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"logit_bias": {"notatoken": 5}}, "logit_bias"),
])
def test_bad_constraints_are_400(api, body, fragment):
    full = {"model": MODEL, "messages": PERSON_PROMPT, "max_tokens": 4, **body}
    r = httpx.post(f"{api.base}{CHAT}", json=full, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_big_body_refused_before_reading(api):
    r = httpx.post(f"{api.base}{CHAT}", content=b"{" + b" " * (5 * 1024 * 1024) + b"}",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
