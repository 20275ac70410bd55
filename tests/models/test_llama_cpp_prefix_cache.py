"""The prefix cache on the llama.cpp backend: an agent loop gives the same tokens with and without it."""

from __future__ import annotations

import pytest

from ..conftest import need

llama_cpp = need("llama_cpp")

from exactspec.speculative.sampling import SamplingParams  # noqa: E402
from exactspec.stats import Stats  # noqa: E402

from ..conftest import prefix_cached, surely_reused  # noqa: E402

SYSTEM = "You are an agent. Tools: search(q), read(url). Reply with a JSON tool call or a short summary."
TOOL = ['search: {"hits": ["Paris is the capital of France", "Lyon is a city"]}', "read: Paris has 2.1 million people."]


@pytest.fixture
def engine(embedded_llamacpp):
    return embedded_llamacpp  # loaded once for the session (conftest)


def agent_loop(engine, params, gamma, seed=0):
    messages, answers, stats = [{"role": "system", "content": SYSTEM}], [], []
    for step, tool in enumerate(TOOL):
        messages.append({"role": "user", "content": tool})
        s = Stats()
        ids = engine.encode(messages)
        out = list(engine.stream_ids(ids, params, 16, gamma, seed + step, s))
        answers.append(out)
        stats.append(s)
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(out, skip_special_tokens=True)})
    return answers, stats


@pytest.mark.parametrize("params,gamma", [(SamplingParams(temperature=0), 4),
                                          (SamplingParams(temperature=1.0), 3)])
def test_cached_equals_uncached_on_llama_cpp(engine, params, gamma):
    engine.set_prefix_cache(None)
    plain, _ = agent_loop(engine, params, gamma)
    with prefix_cached(engine, 32):
        cached, stats = agent_loop(engine, params, gamma)
        again, again_stats = agent_loop(engine, params, gamma)  # the whole first step is cached now
    assert cached == plain == again
    first = again_stats[0].cached_tokens + again_stats[0].prefill_tokens  # the first step's prompt but its last token
    if first >= engine.target.prefill_tile:  # tiled: a prompt under one tile reuses none of a longer one's
        assert again_stats[0].cached_tokens >= max(1, surely_reused(engine, first))
    if not engine.target.prefill_tile:  # tiled: a short first prompt's positions are re-tiled by the second
        assert stats[1].cached_tokens > 0
    assert all(s.cached_tokens + s.prefill_tokens > 0 for s in stats)


def test_agent_steps_over_long_history_equal_uncached(engine):
    """Two agent steps over a ~700-token history: with an f16 cache llama.cpp's one-token decode steps
    write KV that differs in its last bits from a prefill of the same tokens, which once flipped a greedy
    choice here; the generated KV is cached only where the load-time check found the cells equal
    (`cache_generated_kv`), else only the prompt's, so the outputs stay identical either way. The first
    step starts from an empty cache (an uncached run by construction); the second, which continues from
    the cache, is compared with the same step decoded without one."""
    from exactspec.bench.agent import TOOL_PREFIX, exactspec_agent_method, load_agent_workload, opening, replay

    workload = load_agent_workload()
    transcript = workload["transcripts"][0]
    greedy = SamplingParams(temperature=0)
    steps = replay(exactspec_agent_method(engine, None, 0, 32), workload, transcript, greedy, 24, 0, steps=2)
    assert steps[0].cached_tokens == 0
    if engine.target.cache_generated_kv:  # the first step's prompt and (some of) its answer
        assert steps[1].cached_tokens > steps[0].prompt_tokens - 1
    else:
        assert steps[1].cached_tokens == steps[0].prompt_tokens - 1  # the first step's prompt
    uncached = exactspec_agent_method(engine, None, 0, 0)
    uncached.begin()
    messages = opening(workload, transcript) + [
        {"role": "user", "content": TOOL_PREFIX + transcript["steps"][0]}, {"role": "assistant", "content": steps[0].text},
        {"role": "user", "content": TOOL_PREFIX + transcript["steps"][1]}]
    again = uncached.step(messages, greedy, 24, 1)  # replay's seed for step 2
    engine.set_prefix_cache(None)
    assert again.cached_tokens == 0 and again.prompt_tokens == steps[1].prompt_tokens
    assert again.text == steps[1].text
