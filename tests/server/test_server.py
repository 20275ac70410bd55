"""The OpenAI-compatible server as clients meet it: a real uvicorn on 127.0.0.1, the official `openai`
client, raw HTTP for bad bodies, concurrent streams, and clients that hang up mid-generation.

References are computed with the engine BEFORE the server starts: the engine is not thread-safe,
so while the server runs only its worker thread may touch it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

import exactspec.autogamma.measure
from exactspec.engine import Engine, GenerationResult
from exactspec.errors import ExactSpecError
from exactspec.server import create_app
from exactspec.server.cli import add_serve_subcommand, cmd_serve
from exactspec.server.worker import Job
from ..helpers.servers import CHAT, MODEL, SERVED, TEXT, _running, metric

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
COMPLETION_PROMPT = "The capital of France is"
COUNTING_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy keeps counting: no early EOS
BAD_PROMPT = "The capital of Spain is"  # the failure test's generations fail on this prompt
LENIENT = dict(max_new_tokens=40, temperature=0.8, lenience=0.5, gamma=3)  # lossy: accepts more drafts


def test_serve_subcommand_defaults_to_loopback():
    parser = argparse.ArgumentParser()
    add_serve_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--gamma", "3", "--model-name", "m"])
    assert (args.host, args.port, args.gamma, args.model_name, args.target) == ("127.0.0.1", 8000, "3", "m", None)
    assert args.func is cmd_serve
    with pytest.raises(ExactSpecError, match="gamma"):  # refused before the slow model load
        cmd_serve(parser.parse_args(["serve", "--gamma", "-1"]))


@pytest.fixture(scope="module")
def server(embedded):
    """The app on a background uvicorn thread, plus reference outputs computed before it started."""
    refs = SimpleNamespace(
        chat=embedded.generate(MESSAGES, max_new_tokens=12, temperature=0),
        text=embedded.generate(COMPLETION_PROMPT, max_new_tokens=8, temperature=0, chat_template=False),
        sampled=[embedded.generate(COMPLETION_PROMPT, max_new_tokens=8, temperature=1.0, seed=s, chat_template=False)
                 for s in (7, 8)],
        counting=embedded.generate(COUNTING_PROMPT, max_new_tokens=30, temperature=0, chat_template=False),
        chat_sampled=embedded.generate(MESSAGES, max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=40, seed=5),
        lenient=[embedded.generate(COUNTING_PROMPT, chat_template=False, seed=s, **LENIENT) for s in (11, 12)],
    )
    yield from _running(create_app(embedded, model_name=MODEL), refs)


@pytest.fixture(scope="module")
def sequential_server(server, embedded):
    """A second app on the same engine that runs one sample at a time (the fallback path); it serves
    only while `server` is idle, as the engine is not thread-safe."""
    yield from _running(create_app(embedded, model_name=MODEL, max_rows=1), server.refs)


@pytest.fixture(scope="module")
def bigram_server(server, embedded):
    """A third app over the same target, drafting by bigram (a real draft law, what block verification
    applies to; fixed γ 3, so a seed reproduces), with its lone references per rule and seed. Like
    `sequential_server`, it serves only while `server` is idle."""
    engine = Engine(embedded.target, embedded.tokenizer, draft="bigram", gamma=3)
    refs = {(rule, seed): engine.generate(MESSAGES, max_new_tokens=12, temperature=1.0, seed=seed, verification=rule)
            for rule in ("token", "block") for seed in (21, 22)}
    yield from _running(create_app(engine, model_name=MODEL), refs)


@pytest.fixture(autouse=True)
def settled():
    """After each test, wait until every app's worker holds no rows. A response ends when its last token
    is sent, but the row leaves the batch (its KV to the prefix cache, the target's rows compacted) just
    after; the next test's app (or a fixture's own generate) on the shared target raced that once (an
    IndexError in select_rows)."""
    yield
    for app in SERVED:
        wait_for(lambda: app.state.worker.scheduler.rows == 0)


def batched_forwards(base: str) -> float:
    """Batched target forwards the worker has run (each observes its number of rows)."""
    return metric(base, "exactspec_batch_rows_count")


def multi_row_forwards(base: str, more_than: int = 1) -> float:
    """Batched target forwards that served more than `more_than` rows (a bucket bound of the histogram)."""
    return batched_forwards(base) - metric(base, "exactspec_batch_rows_bucket", le=f"{float(more_than)}")


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_chat_completion_equals_engine(server):
    resp = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    ref = server.refs.chat
    assert resp.object == "chat.completion" and resp.model == MODEL and len(resp.choices) == 1
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    spec = resp.model_extra["speculative"]
    assert spec["target_calls"] == ref.stats.target_calls and spec["proposed"] == ref.stats.proposed
    assert spec["accepted"] == ref.stats.accepted
    assert spec["tokens_per_target_call"] == pytest.approx(ref.stats.tokens_per_target_call)


def test_max_completion_tokens_alias(server):
    resp = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3,
                                                 temperature=0)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_text_completion_uses_raw_prompt(server):
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == server.refs.text.text
    assert resp.usage.prompt_tokens == len(server.refs.text.prompt_token_ids)
    listed = server.client.completions.create(model=MODEL, prompt=[COMPLETION_PROMPT], max_tokens=8, temperature=0)
    assert listed.choices[0].text == server.refs.text.text


@pytest.mark.parametrize("gamma", [0, 2, "auto"])
def test_gamma_extension_keeps_greedy_output(server, gamma):
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"gamma": gamma})
    assert resp.choices[0].text == server.refs.text.text
    if gamma == 0:
        assert resp.model_extra["speculative"]["proposed"] == 0


def test_chat_stream_matches_non_stream(server):
    stream = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)  # the client stops at [DONE]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == server.refs.chat.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [server.refs.chat.finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(server.refs.chat.token_ids)
    assert chunks[-1].model_extra["speculative"]["target_calls"] == server.refs.chat.stats.target_calls


def test_n_samples_follow_seed(server):
    """n=2 with seed s runs seeds s and s+1: each choice is exactly the engine's sample for its seed."""
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=1.0,
                                            seed=7, n=2)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.text for r in server.refs.sampled]
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in server.refs.sampled)


def test_streamed_n_samples_interleave_and_follow_seed(server):
    """The n samples of a streamed request decode as rows of one batch: their chunks may interleave,
    and each choice is still exactly the engine's sample for its seed."""
    stream = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=1.0,
                                              seed=7, n=2, stream=True)
    texts, finishes = ["", ""], {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == [r.text for r in server.refs.sampled]
    assert finishes == {i: r.finish_reason for i, r in enumerate(server.refs.sampled)}


def test_seed_is_deterministic_at_temperature_1(server):
    def ask():
        return server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                     temperature=1.0, top_p=0.95, seed=1234)
    first, second = ask(), ask()
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.completion_tokens == second.usage.completion_tokens > 0


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_strings(server, as_list):
    ref = server.refs.chat.text
    word = ref.split()[2]  # a word in the middle of the greedy answer
    stop = ["<never appears>", word] if as_list else word
    resp = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stop=stop)
    assert resp.choices[0].message.content == ref[: ref.index(word)]
    assert resp.choices[0].finish_reason == "stop"


def test_harmless_unknown_fields_are_ignored(server):
    body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 8, "temperature": 0, "user": "me",
            "presence_penalty": 0.5, "logprobs": None, "stream_options": None, "echo": False}
    r = httpx.post(f"{server.base}{TEXT}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == server.refs.text.text


LONG_PROMPT = "word " * 9000  # > 8192 tokens


@pytest.mark.parametrize("path,body,param", [
    (TEXT, b'{"prompt": "hi", "max_tokens": 4', None),  # malformed JSON
    (TEXT, b'["not", "an", "object"]', None),
    (TEXT, {"max_tokens": 4}, "prompt"),  # missing prompt
    (TEXT, {"prompt": 42}, "prompt"),
    (TEXT, {"prompt": ["one", "two"]}, "prompt"),
    (TEXT, {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    (TEXT, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (TEXT, {"prompt": "hi", "temperature": -1}, "temperature"),
    (TEXT, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (TEXT, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (TEXT, {"prompt": "hi", "top_p": 0}, "top_p"),
    (TEXT, {"prompt": "hi", "n": 9}, "n"),
    (TEXT, {"prompt": "hi", "stop": 3}, "stop"),
    (TEXT, {"prompt": "hi", "stream": "yes"}, "stream"),
    (TEXT, {"prompt": "hi", "gamma": -1}, "gamma"),
    (TEXT, {"prompt": "hi", "gamma": "fast"}, "gamma"),
    (TEXT, {"prompt": "hi", "seed": "abc"}, "seed"),
    (TEXT, {"prompt": "hi", "verification": "tree"}, "verification"),
    (CHAT, {"messages": MESSAGES, "verification": "block", "lenience": 0.5}, "verification"),  # block is exact only
    (TEXT, {"prompt": ""}, "prompt"),
    (TEXT, {"prompt": LONG_PROMPT, "max_tokens": 4}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True}, "messages"),
])
def test_bad_request_gets_openai_error(server, path, body, param):
    before = metric(server.base, "exactspec_requests_total", endpoint=path, status="400")
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.base}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert metric(server.base, "exactspec_requests_total", endpoint=path, status="400") == before + 1


def test_unknown_route_is_an_openai_error(server):
    r = httpx.get(f"{server.base}/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_serves_after_bad_requests(server):
    for bad in (b"{", b'{"prompt": "x", "top_p": 2}', json.dumps({"prompt": LONG_PROMPT}).encode()):
        assert httpx.post(f"{server.base}{TEXT}", content=bad, headers={"content-type": "application/json"},
                          timeout=60).status_code == 400
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=0)
    assert resp.choices[0].text == server.refs.text.text
    health = httpx.get(f"{server.base}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_models_lists_the_served_model(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def _inject_failure(engine, monkeypatch) -> None:
    """Generations of BAD_PROMPT blow up after one piece, in the scheduler's delivery (batching.py),
    whichever worker runs them."""
    bad_ids = engine.encode(BAD_PROMPT, chat_template=False)
    real, started = engine.append_tokens, set()

    def flaky_append(result, tokens, stop, sent, final=False):
        if result.prompt_token_ids != bad_ids:
            return real(result, tokens, stop, sent, final)
        if id(result) not in started:
            started.add(id(result))
            return "partial", False
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine, "append_tokens", flaky_append)


@pytest.mark.parametrize("batched", [True, False])
def test_a_failing_generation_fails_only_its_request(request, monkeypatch, batched):
    """Generations of BAD_PROMPT blow up after one piece; requests around them are unaffected."""
    server = request.getfixturevalue("server" if batched else "sequential_server")
    engine = server.app.state.engine
    _inject_failure(engine, monkeypatch)
    failed = metric(server.base, "exactspec_requests_total", endpoint=TEXT, status="500")
    good = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 8, "temperature": 0}
    bad = {**good, "prompt": BAD_PROMPT, "max_tokens": 5}

    async def main():
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            return await asyncio.gather(client.post(TEXT, json=good), client.post(TEXT, json=bad),
                                        client.post(TEXT, json={**bad, "stream": True}), client.post(TEXT, json=good))

    before_good, plain_bad, streamed_bad, after_good = asyncio.run(main())
    for r in (before_good, after_good):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.refs.text.text
    assert plain_bad.status_code == 500
    error = plain_bad.json()["error"]
    assert error["type"] == "server_error" and "injected failure" in error["message"]
    events = [line[len("data: "):] for line in streamed_bad.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[1])["choices"][0]["text"] == "partial"
    assert "injected failure" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    assert metric(server.base, "exactspec_requests_total", endpoint=TEXT, status="500") == failed + 2
    with pytest.raises(openai.APIError, match="injected failure"):  # the official client surfaces in-band errors
        list(server.client.completions.create(model=MODEL, prompt=BAD_PROMPT, max_tokens=5, temperature=0,
                                              stream=True))


async def _stream_chat(client: httpx.AsyncClient) -> dict:
    """One raw SSE chat stream: its text, usage, finish reasons and whether it ended with [DONE]."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    async with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line and not line.startswith(":"):  # an SSE comment: the keep-alive of a slow first token
                assert line.startswith("data: ")
                events.append(line[len("data: "):])
    chunks = [json.loads(e) for e in events[:-1]]
    return {
        "done": events[-1] == "[DONE]",
        "text": "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]),
        "usage": chunks[-1].get("usage"),
        "finish": [c["choices"][0]["finish_reason"] for c in chunks
                   if c["choices"] and c["choices"][0]["finish_reason"]],
    }


def test_concurrent_streams_are_exact_and_counted(server):
    clients = 16
    emitted = metric(server.base, "exactspec_emitted_tokens_total")
    ok = metric(server.base, "exactspec_requests_total", endpoint=CHAT, status="200")
    forwards, wide = batched_forwards(server.base), multi_row_forwards(server.base, more_than=8)
    peak = []

    async def watch_queue(stop: asyncio.Event, client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            peak.append((await client.get("/health")).json()["queued"])
            await asyncio.sleep(0.05)

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(base_url=server.base, timeout=120, limits=limits) as client:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_queue(stop, client))
            results = await asyncio.gather(*(_stream_chat(client) for _ in range(clients)))
            stop.set()
            await watcher
            return results

    results = asyncio.run(asyncio.wait_for(main(), timeout=150))
    ref = server.refs.chat
    assert len(results) == clients
    for r in results:
        assert r["done"] and r["text"] == ref.text and r["finish"] == [ref.finish_reason]
        assert r["usage"]["completion_tokens"] == len(ref.token_ids)
    assert peak and max(peak) <= clients, "/health did not answer while the worker was busy"
    assert batched_forwards(server.base) - forwards < clients * server.refs.chat.stats.target_calls
    assert multi_row_forwards(server.base, more_than=8) > wide, "the concurrent requests were never batched"
    received = sum(r["usage"]["completion_tokens"] for r in results)
    assert metric(server.base, "exactspec_emitted_tokens_total") - emitted == received
    assert metric(server.base, "exactspec_requests_total", endpoint=CHAT, status="200") - ok == clients
    assert metric(server.base, "exactspec_running_requests") == 0


def test_concurrent_mixed_requests_share_batches_exactly(server, monkeypatch):
    """Requests with different prompts, lengths, sampling parameters, γ and n join one running batch;
    each is exactly what it is alone, and the counters add up. The "auto" request joins while the
    batch runs and finds the target's speed unmeasured: measuring it must not disturb the batch."""
    engine, refs = server.app.state.engine, server.refs
    monkeypatch.setattr(engine.drafts.learned, "_target_costs", None)
    quick = functools.partial(exactspec.autogamma.measure.measure_target, context=20, reps=1)  # it still resets the cache
    monkeypatch.setattr(exactspec.autogamma.measure, "measure_target", quick)
    monkeypatch.setattr(exactspec.autogamma.measure, "measure_deeper", lambda *a, **k: ([], []))  # the base depth only
    text = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 8, "temperature": 0}
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12}
    first = (TEXT, {**text, "prompt": COUNTING_PROMPT, "max_tokens": 30, "gamma": 2}, [refs.counting])
    joining = [(TEXT, {**text, "gamma": 0}, [refs.text]),
               (TEXT, {**text, "gamma": "auto"}, [refs.text]),
               (TEXT, {**text, "temperature": 1.0, "seed": 7, "n": 2}, refs.sampled),
               (CHAT, {**chat, "temperature": 0}, [refs.chat]),
               (CHAT, {**chat, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 5}, [refs.chat_sampled])]
    counters = ("exactspec_emitted_tokens_total", "exactspec_draft_tokens_total", "exactspec_accepted_tokens_total")
    before = [metric(server.base, name) for name in counters]
    forwards, multi = batched_forwards(server.base), multi_row_forwards(server.base)

    async def main():
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as client:
            long_one = asyncio.create_task(client.post(first[0], json=first[1]))
            await asyncio.sleep(0.5)  # the others join the running batch
            rest = await asyncio.gather(*(client.post(path, json=body) for path, body, _ in joining))
            return [await long_one, *rest]

    responses = asyncio.run(main())
    bodies = [r.json() for r in responses]
    for r, body, (_, _, expected) in zip(responses, bodies, [first, *joining]):
        assert r.status_code == 200, r.text
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]
        assert texts == [e.text for e in expected]
        assert body["usage"]["completion_tokens"] == sum(len(e.token_ids) for e in expected)
    sums = [sum(b["usage"]["completion_tokens"] for b in bodies),
            sum(b["speculative"]["proposed"] for b in bodies), sum(b["speculative"]["accepted"] for b in bodies)]
    assert [metric(server.base, name) - b for name, b in zip(counters, before)] == sums
    assert multi_row_forwards(server.base) > multi, "the requests were never batched"
    assert batched_forwards(server.base) - forwards < sum(b["speculative"]["target_calls"] for b in bodies)


def test_block_verification_of_point_mass_drafts_is_the_token_rule(server):
    """`verification: "block"` on this server's prompt-lookup drafts (point masses): they keep the coupled
    token rule, so a seed gives the token rule's text, and `speculative` says the token rule verified them."""
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=1.0,
                                            seed=7, extra_body={"verification": "block"})
    spec = resp.model_extra["speculative"]
    assert resp.choices[0].text == server.refs.sampled[0].text
    assert spec["verification"] == "token" and spec["block_verified"] == 0 and spec["exact"] is True


def test_block_and_token_requests_share_a_batch_each_by_its_rule(bigram_server):
    """A block and a token request (n = 2 each) at once: their rows decode in shared target forwards, each
    by its own rule and each exactly its lone run for its seed; `speculative` names the rule that verified
    the drafts and counts the target calls verified as a block."""
    srv = bigram_server
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 21, "n": 2}
    multi = multi_row_forwards(srv.base)

    async def main():
        async with httpx.AsyncClient(base_url=srv.base, timeout=120) as client:
            return await asyncio.gather(client.post(CHAT, json={**body, "verification": "block"}),
                                        client.post(CHAT, json=body))  # "token": the default

    for r, rule in zip(asyncio.run(main()), ("block", "token")):
        assert r.status_code == 200, r.text
        refs = [srv.refs[(rule, seed)] for seed in (21, 22)]
        assert [c["message"]["content"] for c in r.json()["choices"]] == [ref.text for ref in refs]
        spec = r.json()["speculative"]
        assert spec["verification"] == rule and spec["exact"] is True
        assert spec["block_verified"] == sum(ref.stats.block_verified for ref in refs)
        assert (spec["block_verified"] > 0) == (rule == "block")
    assert multi_row_forwards(srv.base) > multi, "the requests were never batched"


def test_concurrent_lenient_requests_share_a_batch(server):
    """Lenient (lossy) rows batch like any others (the scheduler's one admission rule, batching.py): two
    concurrent lenient requests share target forwards, and each is what it is alone."""
    body = {"model": MODEL, "prompt": COUNTING_PROMPT, "max_tokens": LENIENT["max_new_tokens"],
            **{k: v for k, v in LENIENT.items() if k != "max_new_tokens"}}
    multi = multi_row_forwards(server.base)

    async def main():
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as client:
            return await asyncio.gather(*(client.post(TEXT, json={**body, "seed": s}) for s in (11, 12)))

    for r, ref in zip(asyncio.run(main()), server.refs.lenient):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text and r.json()["speculative"]["exact"] is False
    assert multi_row_forwards(server.base) > multi, "the lenient requests were never batched"


def test_failures_in_the_batch_stay_with_their_jobs(server, monkeypatch):
    """A job whose setup fails fails alone; a failing batched forward fails the rows it served, and the
    worker goes on serving."""
    worker, engine, ref = server.app.state.worker, server.app.state.engine, server.refs.text
    target = engine.target

    def job(**options) -> Job:
        request = engine.request(**{"max_new_tokens": 8, "temperature": 0, **options})
        return Job(GenerationResult("", [], list(ref.prompt_token_ids), "length"), request)

    async def outcome(jobs: list[Job]):
        try:
            async for _ in worker.generate_all(jobs):
                pass
        except Exception as e:
            return e
        return [j.result.text for j in jobs]

    async def setup_failure():
        return await asyncio.gather(outcome([job()]), outcome([job(draft="no-such-drafter")]), outcome([job()]))

    good, bad, also_good = asyncio.run(setup_failure())
    assert good == also_good == [ref.text]
    assert isinstance(bad, ExactSpecError) and "no-such-drafter" in str(bad)

    real = target.forward_rows

    def fails_with_two_rows(ids, **kwargs):
        if ids.shape[0] > 1:
            raise RuntimeError("injected forward failure")
        return real(ids, **kwargs)

    monkeypatch.setattr(target, "forward_rows", fails_with_two_rows)
    failed = asyncio.run(outcome([job(), job()]))  # a request's two samples: one batch of two rows
    monkeypatch.undo()
    assert isinstance(failed, RuntimeError) and "injected forward failure" in str(failed)
    assert worker.alive and asyncio.run(outcome([job()])) == [ref.text]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_generation(server, stream):
    max_tokens = 2000
    cancelled = metric(server.base, "exactspec_cancelled_generations_total")
    emitted = metric(server.base, "exactspec_emitted_tokens_total")
    gone = metric(server.base, "exactspec_requests_total", endpoint=TEXT, status="499")
    body = {"model": MODEL, "prompt": COUNTING_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.base}{TEXT}", json=body) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[len("data: "):])["object"] == "text_completion"
    else:  # a non-streaming client that gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base}{TEXT}", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert wait_for(lambda: metric(server.base, "exactspec_cancelled_generations_total") == cancelled + 1), \
        "the generation was not cancelled"
    assert metric(server.base, "exactspec_requests_total", endpoint=TEXT, status="499") == gone + 1
    assert metric(server.base, "exactspec_emitted_tokens_total") - emitted < max_tokens / 4
    assert metric(server.base, "exactspec_running_requests") == 0
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=0)
    assert resp.choices[0].text == server.refs.text.text
