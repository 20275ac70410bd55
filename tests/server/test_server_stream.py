"""Streaming with the official `openai` client: logprobs ride on the chunks whose text their tokens
carry (concatenated, the non-streamed list), and tool calls stream as a header then argument deltas
(concatenated, the non-streamed arguments string) -- speculative decoding on (gamma 4), T = 0."""

from __future__ import annotations

import json

import pytest

from exactspec.server import create_app
from exactspec.server.tools import CallReader, plan_tools

from ..helpers.servers import MODEL, _running
from ..helpers.servers import TIME, WEATHER, WEATHER_PROMPT

STORY = [{"role": "user", "content": "Repeat this sentence exactly: Tom was a mischievous cat with a fluffy coat "
                                    "and a curious mind."}]  # copied: prompt-lookup drafts are accepted
EMOJI = [{"role": "user", "content": "Reply with emojis only: 🎉🚀🎉🚀"}]  # each emoji: three byte-level tokens
TRICKY = '{"city":"Pa\\"}ris","x":[1,{"a":"]"}]}'  # an escaped quote, braces inside strings, nesting
NAMED = {"type": "function", "function": {"name": "get_weather"}}
AUTO_PROMPT = [{"role": "user", "content": "Reply with <tool_call> to get the weather in Paris."}]


@pytest.fixture(scope="module", params=[16, 1], ids=["batched", "one-at-a-time"])
def api(embedded, request):
    yield from _running(create_app(embedded, model_name=MODEL, max_rows=request.param), None)


def _chat_stream(api, **kwargs) -> list:
    return list(api.client.chat.completions.create(stream=True, **kwargs))


def _entries(lp) -> list[tuple]:
    return [(e.token, round(e.logprob, 4), tuple(e.bytes), tuple((t.token, round(t.logprob, 4)) for t in e.top_logprobs))
            for e in lp.content]


@pytest.mark.parametrize("messages,stop", [(STORY, None), (STORY, [" coat and"]), (EMOJI, None)],
                         ids=["plain", "stop", "multibyte"])
def test_chat_logprobs_stream_equal_non_streamed(api, embedded, messages, stop):
    kwargs = dict(model=MODEL, messages=messages, max_tokens=40 if messages is STORY else 16, temperature=0,
                  logprobs=True, top_logprobs=2,
                  stop=stop, extra_body={"gamma": 4})
    response = api.client.chat.completions.create(**kwargs)
    assert response.model_extra["speculative"]["accepted"] > 0  # speculation at work, drafts accepted
    whole = response.choices[0]
    chunks = list(api.client.chat.completions.create(stream=True, **kwargs))
    streamed, text = [], ""
    for chunk in chunks:
        choice = chunk.choices[0]
        entries = _entries(choice.logprobs) if choice.logprobs else []
        if choice.delta.content:  # a text chunk carries exactly its tokens
            if messages is EMOJI:  # each character spans several tokens (each decoding to U+FFFD alone):
                assert "\ufffd" not in text  # a partial character waits (but the last one, cut by length)
                if "\ufffd" not in choice.delta.content:
                    tokens = embedded.tokenizer.encode(choice.delta.content, add_special_tokens=False)
                    assert len(entries) == len(tokens)
            else:
                assert "".join(e[0] for e in entries) == choice.delta.content
            text += choice.delta.content
        else:  # the role chunk carries none; the finish chunk only tokens whose text is never sent
            assert not entries or choice.finish_reason
        streamed += entries
    assert text == whole.message.content and chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert streamed == _entries(whole.logprobs) and len(streamed) > 3
    if messages is EMOJI:  # `bytes` is each token's own bytes, not its lone decode's U+FFFD: together, the text
        joined = b"".join(bytes(e.bytes) for e in whole.logprobs.content)
        assert b"\xef\xbf\xbd" not in joined and joined.decode("utf-8", "ignore") == text.rstrip("\ufffd")
    if messages is STORY and not stop:  # EOS adds no text: its entry comes on the finish chunk
        assert whole.finish_reason == "stop" and len(chunks[-1].choices[0].logprobs.content) == 1
    if stop:  # " coat" is held back (it may start the stop string), then the stop string's tokens are
        # reported as in the non-streamed response, on the finish chunk
        assert whole.finish_reason == "stop" and whole.message.content.endswith("fluffy")
        assert [e.token for e in chunks[-1].choices[0].logprobs.content] == [" coat", " and"]


def test_completion_logprobs_stream_equal_non_streamed(api):
    kwargs = dict(model=MODEL, prompt="one two three four five one two three four five one two",
                  max_tokens=10, temperature=0, logprobs=2,
                  extra_body={"gamma": 4})
    response = api.client.completions.create(**kwargs)
    assert response.model_extra["speculative"]["accepted"] > 0
    whole = response.choices[0].logprobs
    lists = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in api.client.completions.create(stream=True, **kwargs):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            assert "".join(lp.tokens) == chunk.choices[0].text
            for key, values in lists.items():
                values += getattr(lp, key)
    assert lists["tokens"] == whole.tokens and lists["text_offset"] == whole.text_offset
    assert lists["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-4)
    assert [sorted(d) for d in lists["top_logprobs"]] == [sorted(d) for d in whole.top_logprobs]


def _tool_deltas(chunks) -> list:
    return [call for chunk in chunks for choice in chunk.choices for call in (choice.delta.tool_calls or [])]


@pytest.mark.parametrize("choice,messages", [(NAMED, WEATHER_PROMPT), ("required", WEATHER_PROMPT),
                                             ("auto", AUTO_PROMPT)], ids=["named", "required", "auto"])
def test_tool_call_streams_header_then_argument_deltas(api, choice, messages):
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=40,
                  temperature=0, extra_body={"gamma": 4})
    whole = api.client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    want = whole.message.tool_calls[0].function
    assert json.dumps(json.loads(want.arguments), separators=(",", ":")) == want.arguments  # the model's compact text
    chunks = list(api.client.chat.completions.create(stream=True, **kwargs))
    head, *rest = _tool_deltas(chunks)
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == want.name and head.function.arguments == ""
    assert len(rest) > 1 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == want.arguments
    assert not any(choice.delta.content for chunk in chunks for choice in chunk.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    with api.client.chat.completions.stream(**kwargs) as stream:  # the client's own accumulation
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.tool_calls[0].function.name == want.name
    assert final.message.tool_calls[0].function.arguments == want.arguments


def test_tool_call_logprobs_cover_every_token(api):
    kwargs = dict(model=MODEL, messages=WEATHER_PROMPT, tools=[WEATHER, TIME], tool_choice="required",
                  max_tokens=40, temperature=0, logprobs=True, extra_body={"gamma": 4})
    whole = api.client.chat.completions.create(**kwargs).choices[0]
    chunks = _chat_stream(api, **kwargs)
    streamed = [e for c in chunks if c.choices[0].logprobs for e in _entries(c.choices[0].logprobs)]
    assert streamed == _entries(whole.logprobs)


def test_tool_call_cut_by_max_tokens(api):
    """Streamed, a call cut short stays a call (its deltas were sent) and ends with "length";
    non-streamed, the same output is content."""
    kwargs = dict(model=MODEL, messages=WEATHER_PROMPT, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=3,
                  temperature=0)
    whole = api.client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content and not whole.message.tool_calls
    chunks = _chat_stream(api, **kwargs)
    head, *rest = _tool_deltas(chunks)
    assert head.function.name == "get_weather"
    assert "".join(d.function.arguments for d in rest) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_required_head_cut_before_the_name_streams_as_content(api):
    kwargs = dict(model=MODEL, messages=WEATHER_PROMPT, tools=[WEATHER, TIME], tool_choice="required", max_tokens=2,
                  temperature=0)
    whole = api.client.chat.completions.create(**kwargs).choices[0]
    chunks = _chat_stream(api, **kwargs)
    assert not _tool_deltas(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"


@pytest.mark.parametrize("choice,text,arguments", [
    ("required", '{"name":"get_weather","arguments":' + TRICKY + "}", TRICKY),
    ("auto", '<tool_call>{"name":"get_time","arguments":{}}', "{}"),
    (NAMED, '{"city":"Paris"}', '{"city":"Paris"}'),
])
def test_call_reader_any_split(choice, text, arguments):
    """Fed in pieces of any size, the reader finds the same call and argument characters."""
    plan = plan_tools([WEATHER, TIME], choice)
    for size in (1, 2, 5, len(text)):
        reader = CallReader(plan)
        deltas = [d for i in range(0, len(text), size) for d in reader.feed(text[i:i + size])] + reader.flush()
        assert [kind for kind, _ in deltas if kind != "arguments"] == ["call"]
        assert "".join(part for kind, part in deltas if kind == "arguments") == arguments
        assert reader.complete() and plan.read(text, True)[1][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("text", ["Sunny <b>today</b>", "<tool", '<tool_call>{"name":"get_wea'])
def test_call_reader_text_and_held_heads(text):
    """Auto's free text streams at once; a head that never became a call is handed back as content."""
    reader = CallReader(plan_tools([WEATHER, TIME], "auto"))
    deltas = [d for ch in text for d in reader.feed(ch)] + reader.flush()
    assert [kind for kind, _ in deltas] == ["content"] * len(deltas) and "".join(t for _, t in deltas) == text
    assert not reader.complete() and plan_tools([WEATHER, TIME], "auto").read(text, True) == (text, None)
