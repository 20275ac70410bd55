"""Prefix cache across requests: identical outputs with and without it, reuse of exactly the common
prefix, bounded memory, batched rows sharing a cached prefix."""

from __future__ import annotations

import pytest
import torch

from exactspec.speculative.loop import decode
from exactspec.speculative.loop import decode_batch
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.speculative.prefix_cache import PrefixCache, common_prefix
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats

from ..conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, top_k=6)
SYSTEM = [3, 5, 2, 3, 5, 7, 2, 6, 4, 4, 1, 2, 3, 7, 7, 5]  # a shared "system prompt"


@pytest.fixture(scope="module")
def module():
    return tiny_llama(0)


def adapters(module, budget_mb: float = 64.0) -> tuple[FastLlamaLM, FastLlamaLM]:
    """(cached, uncached) adapters over the same weights."""
    cached, plain = FastLlamaLM(module, eos_token_ids=set(), capacity=16), FastLlamaLM(module, eos_token_ids=set(),
                                                                                        capacity=16)
    cached.prefix_cache = PrefixCache(budget_mb)
    return cached, plain


def run(target, prompt, params, gamma, n, seed, stats=None, stop_after=None):
    drafter = PromptLookupDrafter() if gamma else None
    out = []
    for token in decode(target, drafter, prompt, params, gamma, n, torch.Generator().manual_seed(seed), stats):
        out.append(token)
        if stop_after is not None and len(out) >= stop_after:
            break  # the caller stops early (a stop string): the generator is closed
    return out


def agent_steps(target, params, gamma, steps=4, seed=0, stop_after=None):
    """An agent loop: every step re-sends the history + its last answer + a new 'tool output'."""
    history, answers, stats = list(SYSTEM), [], []
    for step in range(steps):
        history += [1 + (step + i) % 7 for i in range(3 + step)]  # the tool output
        s = Stats()
        answer = run(target, history, params, gamma, 10, seed + step, s, stop_after)
        answers.append(answer)
        stats.append(s)
        history += answer
    return answers, stats


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([2], [1]) == 0
    assert all(common_prefix(list(range(50)), list(range(k)) + [99]) == k for k in range(51))


@pytest.mark.parametrize("params,gamma", [(GREEDY, 0), (GREEDY, 3), (SAMPLED, 0), (SAMPLED, 3)])
def test_cached_agent_loop_equals_uncached(module, params, gamma):
    cached, plain = adapters(module)
    with_cache, stats = agent_steps(cached, params, gamma)
    without, plain_stats = agent_steps(plain, params, gamma)
    assert with_cache == without
    assert stats[0].cached_tokens == 0 and all(s.cached_tokens > 0 for s in stats[1:])
    for s, p in zip(stats, plain_stats):  # every prompt token is either reused or prefilled
        assert s.cached_tokens + s.prefill_tokens == p.prefill_tokens and p.cached_tokens == 0
    # step k reuses the whole of step k-1's prompt and answer except the answer's last token
    cache = cached.prefix_cache
    assert cache.hits == 3 and cache.reused_tokens == sum(s.cached_tokens for s in stats)


def test_early_stop_keeps_a_consistent_cache(module):
    cached, plain = adapters(module)
    a, _ = agent_steps(cached, SAMPLED, 3, seed=5, stop_after=4)
    b, _ = agent_steps(plain, SAMPLED, 3, seed=5, stop_after=4)
    assert a == b


def test_divergence_midway_reuses_only_the_common_part(module):
    cached, plain = adapters(module)
    first = SYSTEM + [1, 2, 3, 4, 5, 6]
    answer = run(cached, first, GREEDY, 0, 8, 0)
    other = SYSTEM + [1, 2, 7, 7, 7]  # diverges after SYSTEM + [1, 2]
    stats = Stats()
    got = run(cached, other, GREEDY, 0, 8, 0, stats)
    assert stats.cached_tokens == len(SYSTEM) + 2 and stats.prefill_tokens == len(other) - 1 - stats.cached_tokens
    assert got == run(plain, other, GREEDY, 0, 8, 0)
    assert answer == run(plain, first, GREEDY, 0, 8, 0)


def test_never_serves_another_conversations_suffix(module):
    """After conversation A (system + a + its answer) is cached, conversation B (system + b) holds in
    its cache the system prompt and B's own tokens only: KV equal to a fresh prefill of B."""
    cached, plain = adapters(module)
    a = SYSTEM + [7, 6, 5, 4]
    run(cached, a, GREEDY, 0, 6, 0)
    b = SYSTEM + [7, 1, 1]  # shares SYSTEM + [7] with A, then differs
    reused = cached.prefix_cache.prefill(cached, b[:-1])
    assert reused == len(SYSTEM) + 1 and cached.length == len(b) - 1
    plain.reset()
    plain.prefill(torch.tensor([b[:-1]]))
    n = len(b) - 1
    torch.testing.assert_close(cached.k_cache[:, 0, :, :n], plain.k_cache[:, 0, :, :n])
    torch.testing.assert_close(cached.v_cache[:, 0, :, :n], plain.v_cache[:, 0, :, :n])
    # the negative control: A's cached KV differs from B's at the first differing position
    entry = next(iter(cached.prefix_cache.entries.values()))
    assert not torch.allclose(entry.state[0][:, :, len(SYSTEM) + 1], plain.k_cache[:, 0, :, len(SYSTEM) + 1])


def test_lru_eviction_under_a_small_budget(module):
    cached, _ = adapters(module)
    per_token = 2 * len(cached.layers) * cached.n_kv * cached.head_dim * 4  # fp32 k and v
    budget_tokens = 60
    cache = cached.prefix_cache = PrefixCache(budget_tokens * per_token / 2**20)
    prompts = [[i] + SYSTEM for i in range(1, 5)]  # no common prefix between conversations
    for p in prompts:
        run(cached, p, GREEDY, 0, 8, 0)  # each keeps 16 + 8 = 24 tokens
        assert cache.used <= cache.budget
    assert len(cache) == 2 and cache.evictions == 2
    kept = [e.ids[0] for e in cache.entries.values()]
    assert kept == [3, 4]  # the oldest went first
    stats = Stats()
    run(cached, prompts[0] + [1], GREEDY, 0, 4, 0, stats)  # evicted: prefilled again
    assert stats.cached_tokens == 0
    run(cached, prompts[3] + [1], GREEDY, 0, 4, 0, stats)
    assert stats.cached_tokens == len(prompts[3])


def test_a_longer_sequence_supersedes_its_prefix(module):
    cached, _ = adapters(module)
    run(cached, SYSTEM, GREEDY, 0, 4, 0)
    run(cached, SYSTEM + [1, 2], GREEDY, 0, 4, 0)
    assert len(cached.prefix_cache) == 2  # the second does not extend the first's answer
    first = next(iter(cached.prefix_cache.entries.values())).ids
    run(cached, first + [3, 3], GREEDY, 0, 4, 0)  # extends the first conversation
    assert len(cached.prefix_cache) == 2 and all(len(e.ids) > len(first) for e in cached.prefix_cache.entries.values())


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_batched_rows_share_a_cached_prefix(module, params):
    cached, plain = adapters(module)
    run(cached, SYSTEM + [1], GREEDY, 0, 4, 0)  # the system prompt is cached
    prompts = [SYSTEM + [2, 3], SYSTEM + [4, 5, 6], SYSTEM + [2, 3], [5, 5, 5]]
    stats = [Stats() for _ in prompts]

    def batch(target, row_stats=None):
        out = {r: [] for r in range(len(prompts))}
        gens = [torch.Generator().manual_seed(s) for s in range(len(prompts))]
        for r, tokens in decode_batch(target, [PromptLookupDrafter() for _ in prompts], prompts, params, 3, 10,
                                      gens, row_stats):
            out[r] += tokens
        return [out[r] for r in range(len(prompts))]

    assert batch(cached, stats) == batch(plain)
    assert [s.cached_tokens for s in stats] == [len(SYSTEM)] * 3 + [0]
    # the finished rows went to the cache: a follow-up of row 1 reuses its prompt and answer
    follow = Stats()
    answer = batch(plain)[1]
    run(cached, prompts[1] + answer + [1], GREEDY, 0, 4, 0, follow)
    assert follow.cached_tokens == len(prompts[1]) + len(answer) - 1
