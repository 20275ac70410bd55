"""Batched speculative decoding with uneven acceptance: each row is exactly what it would be alone."""

from __future__ import annotations

import pytest
import torch

from exactspec.decode import decode
from exactspec.decode_batch import decode_batch
from exactspec.drafters.ngram import NGramDrafter, PromptLookupDrafter
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.sampling import SamplingParams
from exactspec.stats import Stats

from .conftest import TINY_VOCAB, tiny_llama
from .test_exactness import LENGTH, PROMPT, always_accept, chi_square_p, exact_law
from .test_loop import Scripted

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[3, 5, 2, 3, 5, 7, 2], [1, 2], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [6]]


@pytest.fixture(scope="module")
def fast_tiny() -> FastLlamaLM:
    return FastLlamaLM(tiny_llama(0), eos_token_ids=set(), capacity=16)


def run_batch(target, drafters, prompts, params, gamma, n, seeds, cancelled=None):
    out = {r: [] for r in range(len(prompts))}
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    for r, tokens in decode_batch(target, drafters, prompts, params, gamma, n, gens, cancelled=cancelled):
        out[r] += tokens
    return [out[r] for r in range(len(prompts))]


def run_alone(target, drafter, prompt, params, gamma, n, seed):
    return list(decode(target, drafter, prompt, params, gamma, n, torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_each_row_greedy_equals_row_alone(fast_tiny, gamma):
    drafters = [PromptLookupDrafter(), NGramDrafter(TINY_VOCAB), Scripted(lambda c: []), None]  # row 2 proposes nothing
    batch = run_batch(fast_tiny, drafters, PROMPTS, GREEDY, gamma, 20, [0, 1, 2, 3])
    alone = [run_alone(fast_tiny, d, p, GREEDY, 0, 20, 0) for d, p in zip([None] * 4, PROMPTS)]
    assert batch == alone


def test_sampled_rows_match_alone_with_same_seeds(fast_tiny):
    params = SamplingParams(temperature=1.0, top_k=6)
    batch = run_batch(fast_tiny, [PromptLookupDrafter() for _ in PROMPTS], PROMPTS, params, 3, 16, [10, 11, 12, 13])
    alone = [run_alone(fast_tiny, PromptLookupDrafter(), p, params, 3, 16, s) for p, s in zip(PROMPTS, [10, 11, 12, 13])]
    assert batch == alone


def test_b1_is_identical_to_unbatched_loop(fast_tiny):
    params = SamplingParams(temperature=0.9)
    batch = run_batch(fast_tiny, [NGramDrafter(TINY_VOCAB)], [PROMPTS[0]], params, 4, 24, [5])
    assert batch[0] == run_alone(fast_tiny, NGramDrafter(TINY_VOCAB), PROMPTS[0], params, 4, 24, 5)


def test_row_finishing_on_first_token_leaves_the_batch(fast_tiny):
    first = run_alone(fast_tiny, None, PROMPTS[1], GREEDY, 0, 1, 0)[0]
    fast_tiny.eos_token_ids = {first}
    try:
        batch = run_batch(fast_tiny, [PromptLookupDrafter() for _ in PROMPTS], PROMPTS, GREEDY, 4, 12, [0] * 4)
        alone = [run_alone(fast_tiny, None, p, GREEDY, 0, 12, 0) for p in PROMPTS]
    finally:
        fast_tiny.eos_token_ids = set()
    assert batch[1] == [first] and batch == alone


def test_cancelled_row_stops_others_continue(fast_tiny):
    cancelled = {0}
    batch = run_batch(fast_tiny, [None, None], PROMPTS[:2], GREEDY, 0, 10, [0, 0], cancelled)
    assert len(batch[0]) == 1 and len(batch[1]) == 10


def test_batch_stats_count_one_target_call_per_iteration(fast_tiny):
    rows = [Stats() for _ in PROMPTS]
    total = Stats()
    gens = [torch.Generator().manual_seed(0) for _ in PROMPTS]
    list(decode_batch(fast_tiny, [PromptLookupDrafter() for _ in PROMPTS], PROMPTS, GREEDY, 3, 15, gens, rows, total))
    assert total.emitted == 60 == sum(s.emitted for s in rows)
    assert total.target_calls == max(s.target_calls for s in rows)
    assert total.proposed == sum(s.proposed for s in rows)


def sample_batched_counts(target, params, verifier, batches=750, rows=4):
    counts = torch.zeros(TINY_VOCAB**LENGTH)
    for b in range(batches):
        gens = [torch.Generator().manual_seed(b * rows + r) for r in range(rows)]
        drafters = [NGramDrafter(TINY_VOCAB) for _ in range(rows)]
        out = {r: [] for r in range(rows)}
        for r, tokens in decode_batch(target, drafters, [PROMPT] * rows, params, 2, LENGTH, gens, verifier=verifier):
            out[r] += tokens
        for seq in out.values():
            counts[sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(seq))] += 1
    return counts


def test_batched_rows_follow_target_law(fast_tiny):
    from exactspec.verify import verify

    params = SamplingParams(temperature=1.0)
    law = exact_law(fast_tiny, params)
    assert chi_square_p(sample_batched_counts(fast_tiny, params, verify), law) > 1e-3


def test_batched_negative_control(fast_tiny):
    params = SamplingParams(temperature=1.0)
    law = exact_law(fast_tiny, params)
    assert chi_square_p(sample_batched_counts(fast_tiny, params, always_accept), law) < 1e-6


def test_engine_generate_batch_equals_one_by_one(embedded):
    prompts = ["Rewrite in the past tense: I walk to school.", "List three colours."]
    results, stats = embedded.generate_batch(prompts, n=2, max_new_tokens=20, temperature=0, gamma=4)
    assert len(results) == 4 and stats.target_calls < sum(r.stats.target_calls for r in results)
    for i, r in enumerate(results):
        alone = embedded.generate(prompts[i // 2], max_new_tokens=20, temperature=0, gamma=0)
        assert r.token_ids == alone.token_ids and r.text == alone.text


def test_engine_generate_batch_stop_string(embedded):
    prompt = "Count from one to ten in words, separated by commas."
    full = embedded.generate(prompt, max_new_tokens=30, temperature=0)
    stop = full.text[10:14]
    results, _ = embedded.generate_batch(prompt, n=2, max_new_tokens=30, temperature=0, stop=[stop])
    for r in results:
        assert r.finish_reason == "stop" and stop not in r.text and full.text.startswith(r.text)
