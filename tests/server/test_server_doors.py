"""The three front doors of one server (issue #53): OpenAI chat completions, OpenAI Responses and Anthropic
Messages, through the real `openai` and `anthropic` SDKs against a real in-process server on the
embedded SmolLM2 (llama.cpp), behind an API key. The model is tiny: tool steps are forced
(`required` / `any`) and answers are greedy, so the tests check the protocol and identity, never
what the model says."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from exactspec.server import create_app

from ..helpers.servers import _running

MODEL, KEY = "smol-doors", "sk-test-doors"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
          "required": ["city"], "additionalProperties": False}
FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "Today's weather in a city.", "parameters": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in FLAT_TOOL.items() if k != "type"}}
CLAUDE_TOOL = {"name": "get_weather", "description": "Today's weather in a city.", "input_schema": SCHEMA}
GREEDY = {"temperature": 0}


def serving(engine):
    for served in _running(create_app(engine, model_name=MODEL, api_key=KEY), None):
        served.openai = openai.OpenAI(base_url=f"{served.base}/v1", api_key=KEY, max_retries=0, timeout=120)
        served.claude = anthropic.Anthropic(base_url=served.base, api_key=KEY, max_retries=0, timeout=120)
        yield served


@pytest.fixture(scope="module")
def api(llamacpp_rows):
    """The server on the default backend (llama.cpp)."""
    yield from serving(llamacpp_rows)


@pytest.fixture(scope="module")
def api_torch(embedded):
    """The same server on the torch backend (the tool loops run on both)."""
    yield from serving(embedded)


@pytest.fixture(params=["llama.cpp", "torch"])
def backend_api(request):
    return request.getfixturevalue("api" if request.param == "llama.cpp" else "api_torch")


def events(base: str, path: str, body: dict) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of a streamed response, read off the wire."""
    out, name = [], None
    with httpx.stream("POST", base + path, json=body, headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


def test_responses_text_streamed_equals_whole(api):
    whole = api.openai.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, **GREEDY)
    assert whole.object == "response" and whole.output_text and whole.usage.input_tokens > 0
    assert whole.model_extra["speculative"]["target_calls"] > 0
    stream = events(api.base, "/v1/responses", {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 12,
                                                "stream": True, **GREEDY})
    kinds = [name for name, _ in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"], kinds
    assert [data["sequence_number"] for _, data in stream] == list(range(len(stream)))
    assert all(name == data["type"] for name, data in stream)
    deltas = "".join(data["delta"] for name, data in stream if name == "response.output_text.delta")
    final = stream[-1][1]["response"]
    assert deltas == whole.output_text == final["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_function_tool_loop(backend_api, stream):
    """A forced call, its output sent back under previous_response_id (only the new item), a text answer."""
    client = backend_api.openai
    ask = dict(model=MODEL, tools=[FLAT_TOOL], max_output_tokens=32, **GREEDY)
    if stream:
        with client.responses.stream(input="What is the weather in Paris?", tool_choice="required", **ask) as s:
            kinds = [e.type for e in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(input="What is the weather in Paris?", tool_choice="required", **ask)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    answer = client.responses.create(previous_response_id=first.id, tool_choice="none", **ask,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.output_text and [o.type for o in answer.output] == ["message"]
    assert answer.previous_response_id == first.id
    assert client.responses.retrieve(answer.id).output_text == answer.output_text
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.create(model=MODEL, previous_response_id="resp_nope", input="hi", max_output_tokens=2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_tool_use_loop(backend_api, stream):
    """`any` forces a tool_use; its tool_result goes back; the model answers in text."""
    claude = backend_api.claude
    ask = dict(model=MODEL, max_tokens=32, tools=[CLAUDE_TOOL], extra_body=GREEDY)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        with claude.messages.stream(messages=question, tool_choice={"type": "any"}, **ask) as s:
            kinds = [e.type for e in s]
            first = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    else:
        first = claude.messages.create(messages=question, tool_choice={"type": "any"}, **ask)
    (use,) = first.content
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMA)
    history = question + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": [{"type": "text", "text": "sunny"}]}]}]
    answer = claude.messages.create(messages=history, tool_choice={"type": "none"}, **ask)
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens > 0


def test_messages_stop_sequence_and_count_tokens(api):
    text = api.claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                      messages=[{"role": "user", "content": "Count from one to ten in words."}])
    words = text.content[0].text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = api.claude.messages.create(model=MODEL, max_tokens=24, stop_sequences=[stop], extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Count from one to ten in words."}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.content[0].text.startswith(cut.content[0].text)
    counted = api.claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Count from one to "
                                                                                                 "ten in words."}])
    assert counted.input_tokens == text.usage.input_tokens


def test_one_conversation_is_one_prompt_and_one_text_through_three_doors(api):
    """A system prompt, a question, an earlier call and its result, a follow-up: rendered through each
    door's translation, the same prompt (token counts) and the same greedy text, byte for byte."""
    arguments = '{"city":"Paris"}'
    chat = api.openai.chat.completions.create(
        model=MODEL, max_tokens=24, tools=[CHAT_TOOL], tool_choice="none", **GREEDY, messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": "Should I take an umbrella?"}])
    response = api.openai.responses.create(
        model=MODEL, max_output_tokens=24, tools=[FLAT_TOOL], tool_choice="none", instructions="You are terse.",
        **GREEDY, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "Should I take an umbrella?"}]}])
    message = api.claude.messages.create(
        model=MODEL, max_tokens=24, tools=[CLAUDE_TOOL], tool_choice={"type": "none"}, system="You are terse.",
        extra_body=GREEDY, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                                         {"type": "text", "text": "Should I take an umbrella?"}]}])
    assert chat.usage.prompt_tokens == response.usage.input_tokens == message.usage.input_tokens
    assert chat.choices[0].message.content == response.output_text == message.content[0].text


def test_the_api_key_guards_every_door_in_its_own_shape(api):
    base = api.base
    assert httpx.get(f"{base}/health").status_code == 200  # public
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        chat = httpx.post(f"{base}/v1/chat/completions", headers=headers, json={})
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key", chat.text
        claude = httpx.post(f"{base}/v1/messages", headers=headers, json={})
        assert claude.status_code == 401 and claude.json()["error"]["type"] == "authentication_error", claude.text
        assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 401
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


BAD = [
    ("/v1/responses", {"input": 5}), ("/v1/responses", {"input": []}), ("/v1/responses", {"input": [7]}),
    ("/v1/responses", {"input": [{"type": "image", "url": "x"}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
    ("/v1/responses", {"input": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f"}]}),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": 3, "output": "x"}]}),
    ("/v1/responses", {"input": "hi", "tools": "all"}),
    ("/v1/responses", {"input": "hi", "tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "nope"}}),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "allowed_tools"}}),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "yaml"}}}),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "schema": 3}}}),
    ("/v1/responses", {"input": "hi", "text": "json"}), ("/v1/responses", {"input": "hi", "instructions": 4}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": -1}), ("/v1/responses", {"input": "hi", "temperature": "hot"}),
    ("/v1/responses", {"input": "hi", "previous_response_id": 12}), ("/v1/responses", [1, 2]),
    ("/v1/responses/input_tokens", {"input": 5}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": []}), ("/v1/messages", {"max_tokens": 8, "messages": "hi"}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "tool", "content": "hi"}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a"}]}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}]}]}),
    ("/v1/messages", {"max_tokens": 8, "system": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [CLAUDE_TOOL],
                      "tool_choice": {"type": "sometimes"}}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [CLAUDE_TOOL],
                      "tool_choice": {"type": "tool", "name": "nope"}}),
    ("/v1/messages", {"max_tokens": "8", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"max_tokens": 8, "stop_sequences": "x", "messages": [{"role": "user", "content": "hi"}],
                      "temperature": -1}),
    ("/v1/messages/count_tokens", {"messages": 3}),
]


def test_malformed_requests_are_4xx_in_each_apis_shape_and_the_server_keeps_serving(api):
    headers = {"x-api-key": KEY}
    for path, body in BAD:
        r = httpx.post(api.base + path, json=body, headers=headers, timeout=60)
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        error = r.json()
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"], (body, error)
        else:
            assert error["error"]["message"] and error["error"]["type"] == "invalid_request_error", (body, error)
    ok = api.openai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=2, **GREEDY)
    assert ok.usage.output_tokens == 2


def test_the_key_comes_from_a_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    from exactspec.errors import ExactSpecError
    from exactspec.server.auth import ENV, read_key
    from exactspec.server.cli import loopback

    monkeypatch.delenv(ENV, raising=False)
    assert read_key(None, None) is None
    (tmp_path / "key").write_text("sk-file\nignored\n")
    assert read_key(None, str(tmp_path / "key")) == "sk-file" and read_key("sk-flag", None) == "sk-flag"
    monkeypatch.setenv(ENV, "sk-env")
    assert read_key(None, None) == "sk-env" and read_key("sk-flag", None) == "sk-flag"
    for bad in [("a", str(tmp_path / "key")), (None, str(tmp_path / "missing")), ("has space", None)]:
        with pytest.raises(ExactSpecError):
            read_key(*bad)
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("192.0.2.7") and not loopback("myhost")


def test_a_mid_conversation_system_message_is_rendered_where_it_stands(api):
    """Claude Code's `role: "system"` inside `messages` (and Codex's `developer` items): accepted, and
    rendered in place, so the same conversation through the chat door is the same prompt; the streamed
    `message_start` carries that prompt's real token count."""
    turns = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."},
             {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "And Rome?"}]
    chat = api.openai.chat.completions.create(model=MODEL, max_tokens=4, messages=turns, **GREEDY)
    message = api.claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=[
        *turns[:2], {"role": "system", "content": [{"type": "text", "text": "Answer in one word."},
                                                   {"type": "tool_addition", "tools": []}]}, turns[3]])
    response = api.openai.responses.create(model=MODEL, max_output_tokens=4, **GREEDY, input=[
        *turns[:2], {"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                                         "text": "Answer in one word."}]}, turns[3]])
    assert chat.usage.prompt_tokens == message.usage.input_tokens == response.usage.input_tokens
    assert chat.choices[0].message.content == message.content[0].text == response.output_text
    started = events(api.base, "/v1/messages", {"model": MODEL, "max_tokens": 2, "stream": True, **GREEDY,
                                                "messages": turns})
    assert started[0][1]["message"]["usage"]["input_tokens"] == chat.usage.prompt_tokens


def test_what_agent_clis_send_is_served_not_refused(api):
    """The fields and tool types the coding-agent CLIs send (../shared/notes/agent-requests.md): hosted
    tools, namespace groups, custom tools, reasoning items, beta query strings and headers, thinking,
    context management, cache_control, deferred tools, an output budget far past the context: a 200."""
    responses = {"model": MODEL, "stream": False, "store": False, "include": ["reasoning.encrypted_content"],
                 "reasoning": {"summary": "auto"}, "prompt_cache_key": "s1", "client_metadata": {"x": "1"},
                 "parallel_tool_calls": True, "tool_choice": "auto", "max_output_tokens": 4, **GREEDY,
                 "tools": [FLAT_TOOL, {"type": "web_search", "external_web_access": False},
                           {"type": "namespace", "name": "agents", "description": "Sub-agents.",
                            "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
                           {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}],
                 "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                           {"type": "reasoning", "summary": [], "encrypted_content": "x"},
                           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}]}
    r = httpx.post(api.base + "/v1/responses", json=responses, headers={"authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text[:400]
    messages = {"model": MODEL, "max_tokens": 32000, "stream": False, **GREEDY, "stop_sequences": ["\n"],
                "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
                "output_config": {"effort": "high"}, "metadata": {"user_id": "{}"},
                "tools": [{**CLAUDE_TOOL, "defer_loading": True, "cache_control": {"type": "ephemeral"}},
                          {"type": "web_search_20250305", "name": "web_search"}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi.",
                                                           "cache_control": {"type": "ephemeral"}}]}]}
    r = httpx.post(api.base + "/v1/messages?beta=true", json=messages, timeout=300,
                   headers={"x-api-key": KEY, "anthropic-beta": "claude-code-20250219,context-management-2025-06-27"})
    assert r.status_code == 200, r.text[:400]
    assert r.json()["usage"]["output_tokens"] >= 1


def test_a_last_assistant_message_is_a_prefill_the_answer_continues(api):
    """Messages: a trailing assistant message is continued, not closed (the prompt is the generation
    prompt, then the prefill's text); the chat door's `continue_final_message` is the same request, and
    a raw completion of the rendered text gives the same greedy answer."""
    turns = [{"role": "user", "content": "Count from one to ten in words."}, {"role": "assistant", "content": "one, two,"}]
    message = api.claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=turns)
    chat = api.openai.chat.completions.create(model=MODEL, max_tokens=6, messages=turns, **GREEDY,
                                              extra_body={"continue_final_message": True})
    closed = api.openai.chat.completions.create(model=MODEL, max_tokens=6, messages=turns[:1], **GREEDY)
    assert message.usage.input_tokens == chat.usage.prompt_tokens > closed.usage.prompt_tokens
    assert message.content[0].text == chat.choices[0].message.content
    text = api.openai.completions.create(model=MODEL, max_tokens=6, temperature=0, prompt=(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nCount from one to ten in words.<|im_end|>\n<|im_start|>assistant\none, two,"))
    assert text.usage.prompt_tokens == chat.usage.prompt_tokens and text.choices[0].text == message.content[0].text
    r = httpx.post(api.base + "/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "continue_final_message": True, "messages": turns[:1]})
    assert r.status_code == 400 and "continue_final_message" in r.text
