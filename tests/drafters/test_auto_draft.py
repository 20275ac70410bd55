"""`--draft auto`: a bandit over the drafters, by measured acceptance x cost. Exact whichever arm proposes."""

from __future__ import annotations

import pytest

from exactspec.speculative.loop import decode
from exactspec.drafters.auto import AutoDrafter, DraftBandit
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.engine import Engine
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.speculative.sampling import SamplingParams
from exactspec.autogamma.policy import AutoGamma
from exactspec.autogamma.costs import CostModel
from exactspec.stats import Stats

from ..conftest import TINY_VOCAB, tiny_llama
from ..helpers.laws import CONTROL_SAMPLES, always_accept, batched, batched_counts, chi_square_p, exact_law, own_draft

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = [1e-3] * 9  # T(k) flat in k: speculation pays whenever anything is accepted


def auto(bandit, tiny_draft=None):
    """An AutoDrafter over prompt lookup, bigram and (given `tiny_draft`) a model drafter with its own
    one-row adapter of it, so that many can draft as the rows of one batch."""
    arms = {"prompt-lookup": PromptLookupDrafter(), "bigram": NGramDrafter(TINY_VOCAB)}
    if tiny_draft is not None:
        arms["model"] = own_draft(tiny_draft)()
    return AutoDrafter(bandit, arms)


def test_greedy_output_equals_plain(tiny_target):
    bandit = DraftBandit(FLAT)
    prompt = [3, 5, 2, 3, 5, 7, 2, 3, 5]
    plain = list(decode(tiny_target, None, prompt, SamplingParams(temperature=0), 0, 30))
    stats = Stats()
    got = list(decode(tiny_target, auto(bandit), prompt, SamplingParams(temperature=0), 3, 30, stats=stats))
    assert got == plain
    assert stats.drafts_by and set(stats.drafts_by) <= {"prompt-lookup", "bigram"}
    assert sum(stats.drafts_by.values()) == stats.draft_calls


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5)])
def test_samples_follow_target_law(tiny_target, tiny_draft, params):
    bandit = DraftBandit(FLAT)
    law = exact_law(tiny_target, params)
    counts = batched_counts(batched(tiny_target), lambda: auto(bandit, tiny_draft), params, 2)
    assert chi_square_p(counts, law) > 1e-3
    assert len([a for a in bandit.arms.values() if a.chosen]) >= 2  # several arms did propose


def test_negative_control_is_detected(tiny_target, tiny_draft):
    params = SamplingParams(temperature=1.0)
    law = exact_law(tiny_target, params)
    # CONTROL_SAMPLES (test_exactness: why it suffices): p < 1e-300 here (batched rows seeded from 1234)
    counts = batched_counts(batched(tiny_target), lambda: auto(DraftBandit(FLAT), tiny_draft), params, 2,
                            verifier=always_accept, samples=CONTROL_SAMPLES)
    assert chi_square_p(counts, law) < 1e-6


def test_ranking_follows_acceptance_and_cost():
    bandit = DraftBandit(FLAT)
    good, bad = bandit.arm("good"), bandit.arm("bad")
    good.successes, good.failures, bad.successes, bad.failures = 90, 10, 10, 90
    good.draft_s_per_token = bad.draft_s_per_token = 1e-5
    firsts = [bandit.ranking(["bad", "good"], {}, 4)[0] for _ in range(200)]
    assert firsts.count("good") > 190
    good.draft_s_per_token = 1.0  # accepted often, but 1000x a target step per token: never worth it
    firsts = [bandit.ranking(["bad", "good"], {}, 4)[0] for _ in range(200)]
    assert firsts.count("bad") > 190


def test_a_request_overrides_what_earlier_ones_taught():
    """Earlier requests taught that 'bad' is bad; this request's own outcomes say it accepts everything."""
    bandit = DraftBandit(FLAT)
    bandit.arm("good").successes, bandit.arm("good").failures = 500, 500
    bandit.arm("bad").successes, bandit.arm("bad").failures = 0, 1000
    for arm in bandit.arms.values():
        arm.draft_s_per_token = 1e-5
    local = {}
    assert [bandit.ranking(["bad", "good"], local, 4)[0] for _ in range(50)].count("good") > 45
    local["bad"].successes = 60  # 15 iterations of 4 accepted drafts
    assert [bandit.ranking(["bad", "good"], local, 4)[0] for _ in range(50)].count("bad") > 45


def test_engine_auto_learns_across_requests_and_reports_choices():
    target = FastLlamaLM(tiny_llama(0), eos_token_ids=set(), capacity=32)
    engine = Engine(target, tokenizer=None, draft="auto", gamma=3, chat_template=False)
    copying = [3, 5, 2, 3, 5, 7, 2] * 4
    stats = Stats()
    plain = list(engine.stream_ids(copying, SamplingParams(temperature=0), 24, gamma=0))
    assert list(engine.stream_ids(copying, SamplingParams(temperature=0), 24, stats=stats)) == plain
    assert sum(stats.drafts_by.values()) == stats.draft_calls > 0
    bandit = engine.draft_bandit()
    assert bandit is engine.draft_bandit() and sum(a.chosen for a in bandit.arms.values()) == stats.draft_calls
    more = Stats()
    list(engine.stream_ids(copying, SamplingParams(temperature=1.0), 24, seed=1, stats=more))
    assert sum(a.chosen for a in bandit.arms.values()) == stats.draft_calls + more.draft_calls  # kept per engine


def priced_auto(bandit, policy):
    arms = {"prompt-lookup": PromptLookupDrafter(), "bigram": NGramDrafter(TINY_VOCAB)}
    return AutoDrafter(bandit, arms, policy)


def test_under_auto_gamma_a_priced_copy_comes_before_the_bandits_favourite():
    """The bandit is sure bigram is best, but a long copy is priced first: the copy proposes, to be
    cut by auto γ (the drafter says it copies, and from where)."""
    bandit = DraftBandit(FLAT)
    bandit.arm("bigram").successes, bandit.arm("bigram").failures = 1000, 1
    policy = AutoGamma(CostModel(FLAT * 4, 0.0))
    drafter = priced_auto(bandit, policy)
    assert drafter.copies
    context = [3, 5, 2, 3, 5, 7, 2, 3, 5, 7, 2, 3, 5, 7]
    proposal = drafter.propose(context, 8, SamplingParams(temperature=0), None)
    assert drafter.name == "prompt-lookup" and drafter.source == "context" and len(proposal) and proposal.match >= 3


def test_a_copy_that_does_not_pay_leaves_the_turn_to_a_model_arm():
    """Auto γ has learned that this kind of copy is always rejected: the bigram arm proposes instead,
    at the width auto γ gives its own acceptance; with no model arm the copy is still returned (so
    that auto γ's probes keep measuring it)."""
    policy = AutoGamma(CostModel(FLAT * 4, 0.0))
    for _ in range(200):
        for m in (1, 2, 3, 4, 6, 10, 20, 40):
            policy.acceptance.of(("context", "greedy")).observe(4, 0, m)
    context = [3, 5, 2, 3, 5, 7, 2, 3, 5, 7, 2, 3, 5, 7]
    drafter = priced_auto(DraftBandit(FLAT), policy)
    proposal = drafter.propose(context, 8, SamplingParams(temperature=0), None)
    assert drafter.name == "bigram" and drafter.source == "bigram" and 0 < len(proposal) <= 8
    alone = AutoDrafter(DraftBandit(FLAT), {"prompt-lookup": PromptLookupDrafter()}, policy)
    assert len(alone.propose(context, 8, SamplingParams(temperature=0), None)) and alone.source == "context"


def test_engine_auto_draft_auto_gamma_is_greedy_identical_with_a_store():
    target = FastLlamaLM(tiny_llama(0), eos_token_ids=set(), capacity=64)
    engine = Engine(target, tokenizer=None, draft="auto", gamma="auto", chat_template=False)
    assert engine.drafts.store is not None  # the store is one of auto's arms
    copying = [3, 5, 2, 3, 5, 7, 2] * 4
    plain = list(engine.stream_ids(copying, SamplingParams(temperature=0), 24, gamma=0))
    for _ in range(2):  # the second request finds the first one's text in the store
        stats = Stats()
        assert list(engine.stream_ids(copying, SamplingParams(temperature=0), 24, stats=stats)) == plain
        assert set(stats.drafts_by) <= {"prompt-lookup", "store", "bigram"}
