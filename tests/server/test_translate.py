"""Request translation without HTTP (server/translate.py): a body becomes jobs sharing one Request (its
constraint compiled once), or the ApiError the server would answer; and the route handlers are plain
methods a test can call."""

from __future__ import annotations

import asyncio
import json

import pytest

from exactspec.errors import ExactSpecError

from exactspec.generation import Request
from exactspec.server.app import Routes
from exactspec.server.metrics import Metrics
from exactspec.server.schemas import ChatCompletionRequest, CompletionRequest
from exactspec.server.translate import ApiError, plan_chat, plan_text
from exactspec.server.worker import Worker
from exactspec.speculative import grammar

SCHEMA = {"type": "json_schema", "json_schema": {"name": "point", "strict": True, "schema": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_n_samples_share_one_request_and_one_compiled_constraint(embedded, monkeypatch):
    compiled = []
    real = grammar.grammar_from_spec
    monkeypatch.setattr("exactspec.generation.grammar_from_spec", lambda spec: compiled.append(spec) or real(spec))
    jobs, tools = plan_chat(embedded, chat(n=2, seed=3, max_tokens=5, response_format=SCHEMA))
    assert tools is None and len(jobs) == 2 and len(compiled) == 1
    request = jobs[0].request
    assert isinstance(request, Request) and jobs[1].request is request
    assert request.max_new_tokens == 5 and request.law.matcher is not None
    assert [job.seed for job in jobs] == [3, 4]
    assert jobs[0].result is not jobs[1].result
    assert jobs[0].result.prompt_token_ids == jobs[1].result.prompt_token_ids == embedded.encode("hi")
    # each sample's law gets its own matcher state over the one compiled grammar
    laws = [request.law.law(request.params, job.result, embedded.target.vocab_size) for job in jobs]
    assert laws[0].matcher is not laws[1].matcher and laws[0].matcher is not request.law.matcher


def test_a_text_body_without_a_constraint_has_a_plain_law(embedded):
    body = CompletionRequest.model_validate({"model": "m", "prompt": "Once upon", "max_tokens": 7, "temperature": 0})
    [job] = plan_text(embedded, body)
    assert job.request.law.matcher is None and job.request.max_new_tokens == 7
    assert job.result.prompt_token_ids == embedded.encode("Once upon", chat_template=False)


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"repetition_penalty": 1000}, "repetition_penalty"),
    ({"response_format": {"type": "regex", "regex": "("}}, "response_format"),
    ({"messages": [{"role": "user", "content": ""}], "response_format": {"type": "nonsense"}}, "response_format"),
])
def test_a_bad_field_is_an_api_error_naming_it(embedded, fields, param):
    with pytest.raises(ApiError) as e:
        plan_chat(embedded, chat(**fields))
    assert e.value.status == 400 and e.value.param == param


def test_one_translator_for_the_server_and_the_api(embedded):
    """Request settings are parsed in one place (generation.law_spec): the server's request and
    `Engine.request` refuse the same bias key with the same words, and build the same penalties."""
    with pytest.raises(ApiError) as server:
        plan_chat(embedded, chat(logit_bias={"99999999": 1}))
    with pytest.raises(ExactSpecError) as api:
        embedded.request(logit_bias={"99999999": 1})
    assert server.value.message == str(api.value) and server.value.param == "logit_bias"
    settings = dict(logit_bias={"5": 2.5}, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1)
    [job], _ = plan_chat(embedded, chat(**settings))
    assert job.request.law.penalties == embedded.request(**settings).law.penalties


def test_route_handlers_are_callable_without_http(embedded):
    metrics = Metrics()
    routes = Routes(embedded, Worker(embedded, metrics, 1), metrics, "m", max_tokens_default=64)
    models = asyncio.run(routes.models())
    assert models["data"][0]["id"] == "m" and models["data"][0]["max_tokens_default"] == 64
    health = asyncio.run(routes.health())
    assert health.status_code == 503 and json.loads(health.body)["status"] == "worker stopped"  # never started
