"""The drafters over suffix indexes (drafters/suffix.py): `seen_tail` counts the tokens not indexed yet,
the store keeps to its budget, siblings draft from each other, and sampled siblings stay exact,
independent samples."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch

from exactspec.drafters.suffix import CATCH_UP, LEAD_IN, PromptLookupDrafter, SuffixDrafter
from exactspec.drafters.suffix_index import BYTES_PER_TOKEN, SuffixIndex
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.speculative.loop import decode_batch
from exactspec.speculative.sampling import SamplingParams

from ..conftest import TINY_VOCAB, tiny_llama
from ..helpers.laws import LENGTH, PROMPT, chi_square_p, exact_law

GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("seed,asked", [(seed, asked) for seed in range(3) for asked in (0.3, 0.03)])
def test_seen_tail_counts_the_tokens_since_the_last_lookup(seed, asked):
    """`SuffixDrafter.seen_tail` of a drafter not asked to propose for several tokens (auto γ asks it
    instead of looking up where nothing can be found: lookups.cannot_match), whose index lags the context
    (past CATCH_UP tokens it indexes them): the same as a drafter asked at every token, over texts that copy
    themselves (no rewrites: a copy aligned through them is seen whatever the index holds)."""
    rng = random.Random(seed)
    base = [rng.randrange(15) for _ in range(50)]
    text = base + [rng.randrange(15) if rng.random() < 0.25 else t for t in base]
    lagging, synced = PromptLookupDrafter(), PromptLookupDrafter()
    for drafter in (lagging, synced):
        drafter.rewrites = None
        drafter.read_prompt(text[:20])
    behind = 0
    for end in range(21, len(text) + 1):
        context = text[:end]
        synced.propose(context, 8, GREEDY, None)
        if rng.random() < asked:
            lagging.propose(context, 8, GREEDY, None)
        behind += lagging.index.length(lagging._doc) < len(context) - 1
        for below in (1, 2, 3, 4):
            assert lagging.seen_tail(context, below) == synced.seen_tail(context, below), (end, below)
        assert len(context) - lagging.index.length(lagging._doc) <= CATCH_UP
    assert behind >= 20


def test_a_match_among_the_tokens_not_yet_indexed_is_seen():
    """The n-gram a lookup needs may occur only among the tokens since the last lookup: `seen_tail` looks
    there too (else auto γ would not look up the copy of the answer's own repetition)."""
    drafter = PromptLookupDrafter()
    drafter.read_prompt([1, 2, 3])
    context = [1, 2, 3, 7, 8, 9, 7, 8]  # [7, 8] occurred, followed by 9, among the tokens not indexed
    assert drafter.index.length(drafter._doc) == 3 and drafter.seen_tail(context, 3) == 2
    assert drafter.seen_tail(context[:-1], 3) == 1 and drafter.seen_tail(context[:4], 3) == 0
    proposal = drafter.propose(context, 4, GREEDY, None)
    assert proposal.tokens()[:1] == [9] and proposal.match == 2


def test_prompt_lookup_proposes_from_its_own_context():
    context = [10, 11, 12, 13, 14, 99, 10, 11, 12]
    proposal = PromptLookupDrafter().propose(context, 4, GREEDY, None)
    assert proposal.tokens() == [13, 14, 99, 10] and proposal.match == 3


def test_store_serves_other_requests_and_siblings():
    store = SuffixIndex(budget_mb=1)
    first = SuffixDrafter(store)
    prompt = list(range(100, 120))
    first.propose(prompt, 4, GREEDY, None)
    answer = [7, 8, 9, 1, 2, 3, 4, 5, 6]
    first.finish(prompt + answer)  # its output (with LEAD_IN prompt tokens before it) is in the store
    assert store.tokens == LEAD_IN + len(answer)
    second = SuffixDrafter(store)  # another request, same prompt tail, no output yet: copies the first's answer
    proposal = second.propose([50, 51] + prompt, 5, GREEDY, None)
    assert proposal.tokens() == answer[:5] and second.source == "store"
    sibling = SuffixDrafter(store)
    sibling.propose(prompt + [7, 8], 3, GREEDY, None)  # a sibling mid-answer continues from the other's tokens
    assert sibling.source == "store" and sibling.found.probability > 0.5
    alone = PromptLookupDrafter()
    assert len(alone.propose([50, 51] + prompt, 5, GREEDY, None)) == 0  # without a store: nothing to copy


def test_store_keeps_to_its_budget_and_forgets_oldest_first():
    budget_mb = 1.0
    store = SuffixIndex(budget_mb=budget_mb)
    rng = random.Random(0)
    docs = []
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(40):
        doc = store.new_doc()
        store.extend(doc, [rng.randrange(49152) for _ in range(300)])
        docs.append(doc)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert store.nbytes <= budget_mb * 2**20 and held <= budget_mb * 2**20, held
    assert store.tokens * BYTES_PER_TOKEN == store.nbytes
    assert not store.alive(docs[0]) and store.alive(docs[-1])
    assert sum(len(h) for h in store.heads) <= 3 * store.tokens  # evicted documents left no table entries


def sibling_counts(target, params, same_seed: bool, batches: int = 1500):
    """Two siblings of one prompt drafting from each other through a store: counts of their joint
    LAST tokens, and of every row's whole continuation."""
    joint = torch.zeros(TINY_VOCAB, TINY_VOCAB)
    marginal = torch.zeros(TINY_VOCAB**LENGTH)
    from_store = 0
    for b in range(batches):
        store = SuffixIndex(budget_mb=1)
        drafters = [SuffixDrafter(store, own_context=False), SuffixDrafter(store, own_context=False)]
        seeds = [b, b] if same_seed else [2 * b, 2 * b + 1]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = {0: [], 1: []}
        for r, tokens in decode_batch(target, drafters, [PROMPT] * 2, params, 2, LENGTH, gens):
            out[r] += tokens
            found = drafters[r].found
            from_store += found is not None and found.doc != drafters[r]._store_doc  # the sibling's tokens
        joint[out[0][-1], out[1][-1]] += 1
        for seq in out.values():
            marginal[sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(seq))] += 1
    return joint, marginal, from_store


@pytest.fixture(scope="module")
def fast_tiny() -> FastLlamaLM:
    return FastLlamaLM(tiny_llama(0), eos_token_ids=set(), capacity=16)


@pytest.mark.usefixtures("one_thread")
def test_siblings_drafting_from_each_other_stay_exact_and_independent(fast_tiny):
    """χ²: each sibling follows the target law, and the pair's last tokens follow the PRODUCT of their
    marginals (independent samples) although each drafted from the other's tokens."""
    params = SamplingParams(temperature=1.0)
    law = exact_law(fast_tiny, params)  # [V**L]
    last = law.reshape(-1, TINY_VOCAB).sum(0)  # [V] law of the last token
    joint, marginal, from_store = sibling_counts(fast_tiny, params, same_seed=False)
    assert from_store > 100  # the siblings did draft from each other
    assert chi_square_p(marginal, law) > 1e-3
    assert chi_square_p(joint.flatten(), torch.outer(last, last).flatten()) > 1e-3
    # negative control: siblings sharing their random numbers are not independent, and the test says so
    joint, _, _ = sibling_counts(fast_tiny, params, same_seed=True, batches=500)
    assert chi_square_p(joint.flatten(), torch.outer(last, last).flatten()) < 1e-6


def test_engine_suffix_drafter_copies_an_earlier_answer_and_keeps_greedy_identity(embedded):
    """A repeated request drafts its answer from the store: fewer target calls, the same tokens."""
    prompt = "List the planets of the solar system, comma separated."
    embedded.drafts.set_store(4)
    try:
        plain = embedded.generate(prompt, max_new_tokens=24, temperature=0, gamma=0)
        first = embedded.generate(prompt, max_new_tokens=24, temperature=0, gamma=4, draft="suffix")
        again = embedded.generate(prompt, max_new_tokens=24, temperature=0, gamma=4, draft="suffix")
        assert plain.token_ids == first.token_ids == again.token_ids
        assert again.stats.target_calls < first.stats.target_calls
        assert embedded.drafts.store.nbytes <= 4 * 2**20
        sampled = [embedded.generate_batch(prompt, n=3, max_new_tokens=16, temperature=0.8, seed=5, gamma=g,
                                           draft="suffix")[0] for g in (0, 4, "auto")]
        assert [r.token_ids for r in sampled[0]] == [r.token_ids for r in sampled[1]] == [r.token_ids for r in sampled[2]]
    finally:
        embedded.drafts.set_store(64)


def test_a_store_copy_stops_where_earlier_sessions_disagree():
    """Three earlier answers share a prefix; two go on with 20, the latest with 10. A new request copies
    the shared part from the store, but not into the minority's value: the proposal stops there."""
    store = SuffixIndex(budget_mb=1)
    prompt = [100, 101, 102, 103]
    for value in (20, 20, 10):
        writer = SuffixDrafter(store)
        writer.propose(prompt, 1, GREEDY, None)
        writer.finish(prompt + [1, 2, 3, 4, value, value + 1, value + 2])
    reader = SuffixDrafter(store)
    proposal = reader.propose([7] + prompt, 8, GREEDY, None)
    assert reader.source == "store" and proposal.tokens() == [1, 2, 3, 4]  # cut before the contested value
    agreed = SuffixDrafter(store).propose([7] + prompt + [1, 2, 3, 4, 20], 8, GREEDY, None)
    assert agreed.tokens()[:2] == [21, 22]
