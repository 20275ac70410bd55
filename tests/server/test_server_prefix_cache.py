"""The server's prefix cache as an agent meets it: multi-turn conversations through the official
client, concurrent requests sharing a system prompt; outputs equal the engine's without the cache."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from ..conftest import prefix_cached, surely_reused
from ..helpers.servers import CHAT, MODEL, _running, metric

SYSTEM = ("You are a careful agent. Tools: search(query) returns documents; read(url) returns a page; "
          "calc(expr) returns a number. Answer with a JSON tool call or a one-line summary. " * 3)
TOOL_OUTPUT = 'search returned: {"title": "Rainbow", "text": "Red, orange, yellow, green, blue, indigo, violet."}'


def conversation(turns: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, turn in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    return messages


@pytest.fixture(scope="module")
def cached_server(llamacpp_rows):
    from exactspec.server import create_app

    assert llamacpp_rows.prefix_cache is None
    first = llamacpp_rows.generate(conversation(["Find the colours of the rainbow."]), max_new_tokens=10, temperature=0)
    turns = ["Find the colours of the rainbow.", first.text, TOOL_OUTPUT]
    refs = SimpleNamespace(
        engine=llamacpp_rows, first=first, turns=turns,
        second=llamacpp_rows.generate(conversation(turns), max_new_tokens=10, temperature=0),
        sampled=llamacpp_rows.generate(conversation(turns), max_new_tokens=10, temperature=1.0, seed=3),
        users=[llamacpp_rows.generate(conversation([f"Question {i}: what is {i} + {i}?"]), max_new_tokens=8,
                                 temperature=0) for i in range(4)],
    )
    with prefix_cached(llamacpp_rows):
        yield from _running(create_app(llamacpp_rows, model_name=MODEL), refs)


def test_agent_turns_reuse_the_history_and_equal_uncached(cached_server):
    client, refs = cached_server.client, cached_server.refs
    hits = metric(cached_server.base, "exactspec_prefix_cache_hits_total")
    first = client.chat.completions.create(model=MODEL, messages=conversation(refs.turns[:1]), max_tokens=10,
                                           temperature=0)
    assert first.choices[0].message.content == refs.first.text
    second = client.chat.completions.create(model=MODEL, messages=conversation(refs.turns), max_tokens=10,
                                            temperature=0)
    assert second.choices[0].message.content == refs.second.text
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the history (system, first question, the answer as the template renders it) came from the cache
    assert surely_reused(refs.engine, len(refs.first.prompt_token_ids) - 1) <= cached < second.usage.prompt_tokens
    sampled = client.chat.completions.create(model=MODEL, messages=conversation(refs.turns), max_tokens=10,
                                             temperature=1.0, seed=3)
    assert sampled.choices[0].message.content == refs.sampled.text
    assert sampled.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert metric(cached_server.base, "exactspec_prefix_cache_hits_total") - hits >= 2
    reused = metric(cached_server.base, "exactspec_prompt_tokens_total", source="cached")
    prefilled = metric(cached_server.base, "exactspec_prompt_tokens_total", source="prefilled")
    assert reused >= cached + sampled.usage.prompt_tokens_details.cached_tokens and prefilled > 0
    assert metric(cached_server.base, "exactspec_prefix_cache_bytes") > 0


def test_concurrent_requests_sharing_a_system_prompt(cached_server):
    refs = cached_server.refs

    async def ask(client: httpx.AsyncClient, i: int) -> dict:
        body = {"model": MODEL, "messages": conversation([f"Question {i}: what is {i} + {i}?"]), "max_tokens": 8,
                "temperature": 0}
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=cached_server.base, timeout=120) as client:
            return await asyncio.gather(*(ask(client, i) for i in range(4)))

    # a turn first, so that the cache holds the system prompt whichever tests ran before in this process
    cached_server.client.chat.completions.create(model=MODEL, messages=conversation(["Hello."]), max_tokens=1,
                                                 temperature=0)
    results = asyncio.run(asyncio.wait_for(main(), timeout=150))
    system_tokens = len(refs.first.prompt_token_ids) - 20  # the system prompt (and template header), at least
    for i, r in enumerate(results):
        assert r["choices"][0]["message"]["content"] == refs.users[i].text
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= surely_reused(refs.engine, system_tokens)
