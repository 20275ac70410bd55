"""Long accepted runs: copy-aware prompt lookup, auto γ by match length, batched pricing, and what the
engine learns across requests. Greedy identity with proposals up to γ = 32, Monte-Carlo exactness of
variable-length point-mass proposals (with a negative control), and the policy's choices on scripted
acceptance histories (injected costs, no timing)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from exactspec.bench.workloads import load_workload
from exactspec.autogamma.policy import AutoGamma, batch_value, ragged_widths
from exactspec.autogamma.costs import CostModel, passes
from exactspec.autogamma.acceptance import bucket
from exactspec.speculative.loop import decode
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.engine import Engine
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats

from exactspec.speculative.verify import verify

from ..conftest import TINY_VOCAB
from ..helpers.laws import LENGTH, PROMPT, SAMPLES, always_accept, chi_square_p, exact_law
from ..helpers.costs import Q41, q41_cost

GREEDY = SamplingParams(temperature=0)
# llama.cpp Q4_1 on this machine: T(k)/T(1) for k = 1..33 (measured at 1, 2, 3, 4, 6, 8, 12, 16, 32; linear between)
Q41 += [7.54 + (13.8 - 7.54) * (k - 16) / 16 for k in range(17, 33)] + [14.2]


# --- the drafter ------------------------------------------------------------------------------------
def test_prompt_lookup_reports_match_length_and_prefers_the_longest_match():
    source = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    decoy = [99, 13, 14, 15, 50, 51]  # a later, shorter occurrence of the tail [13, 14, 15]
    context = source + decoy + [10, 11, 12, 13, 14, 15]
    proposal = PromptLookupDrafter().propose(context, 32, GREEDY, None)
    assert proposal.tokens() == [16, 17, 18, 19, 20, 99, 13, 14, 15, 50, 51, 10, 11, 12, 13, 14, 15]
    assert proposal.match == 6  # the whole [10..15] agrees, not just the 3-gram
    assert PromptLookupDrafter().propose([1, 2, 3], 4, GREEDY, None).match == 0  # no earlier occurrence
    assert [bucket(m) for m in (None, 0, 1, 2, 4, 8, 16, 32, 64)] == [0, 0, 1, 2, 3, 4, 5, 6, 7]


# --- greedy identity with long proposals ------------------------------------------------------------
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("gamma", [8, 16, 32, "auto"])
def test_tiny_greedy_identity_long_proposals(tiny_target, gamma):
    prompt = [3, 5, 2, 3, 5, 7, 2, 4, 6, 1, 3, 5, 2, 3, 5, 7, 2, 4, 6, 1, 3, 5, 2]
    plain = list(decode(tiny_target, None, prompt, GREEDY, 0, 60))
    policy = AutoGamma(CostModel([0.01 * (1 + 0.02 * k) for k in range(33)], frozen=True)) if gamma == "auto" else gamma
    stats = Stats()
    out = list(decode(tiny_target, PromptLookupDrafter(), prompt, GREEDY, policy, 60, torch.Generator(), stats))
    assert out == plain and stats.proposed > 0


def test_embedded_greedy_identity_long_proposals(embedded):
    """An edit prompt on the embedded model: γ = 16, 32 and auto decode what plain greedy decodes."""
    prompt = load_workload("edit")[1]
    plain = embedded.generate(prompt, max_new_tokens=80, temperature=0, gamma=0)
    for gamma in (16, 32, "auto"):
        spec = embedded.generate(prompt, max_new_tokens=80, temperature=0, gamma=gamma)
        assert spec.token_ids == plain.token_ids, f"gamma={gamma}"
        assert max(i for i, n in enumerate(spec.stats.run_lengths) if n) >= 8, spec.stats.run_lengths  # long runs


# --- exactness at T = 1: variable-length point-mass proposals ---------------------------------------
def copy_auto() -> AutoGamma:
    """A fresh policy whose γ follows the match length: with these costs a 2-token match (prior α 0.6)
    gets 2 drafts, a 1-token match (α 0.5) 1 draft; no match, none."""
    return AutoGamma(CostModel([1.0, 1.45, 1.75, 2.2], frozen=True), min_gain=1.0)


def fresh_policy_counts(target, make_drafter, params, verifier=verify, samples=SAMPLES) -> torch.Tensor:
    """`sample_counts` with a fresh policy per sample: each sample's γ choices depend on its own
    history only, so the samples are independent."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(TINY_VOCAB**LENGTH)
    for _ in range(samples):
        out = list(decode(target, make_drafter(), PROMPT, params, copy_auto(), LENGTH, gen, verifier=verifier))
        counts[sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(out))] += 1
    return counts


class Counting(PromptLookupDrafter):
    """Prompt lookup that counts the proposal lengths the policy kept."""

    kept: Counter = Counter()

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        Counting.kept[num_proposed] += 1


@pytest.mark.usefixtures("one_thread")
def test_copy_aware_auto_samples_follow_target_law(tiny_target):
    """Auto keeps a prefix of each copy chosen from its match length and history (0, 1 or 2 tokens
    here): the samples still follow the target law."""
    params = SamplingParams(temperature=1.0)
    law = exact_law(tiny_target, params)
    Counting.kept = Counter()
    counts = fresh_policy_counts(tiny_target, Counting, params, samples=2000)
    p = chi_square_p(counts, law)
    assert p > 1e-3, f"chi-square p={p:.2e}"
    assert Counting.kept[1] > 50 and Counting.kept[2] > 50, Counting.kept  # variable-length proposals


@pytest.mark.usefixtures("one_thread")
def test_copy_aware_negative_control(tiny_target):
    params = SamplingParams(temperature=1.0)
    law = exact_law(tiny_target, params)
    counts = fresh_policy_counts(tiny_target, PromptLookupDrafter, params, verifier=always_accept, samples=500)
    assert chi_square_p(counts, law) < 1e-6


# --- the policy on scripted acceptance histories (llama.cpp Q4_1 costs, no timing) -------------------
def test_fresh_policy_dares_long_copies_but_not_short_matches():
    """No history yet: a long match is speculated on at once (a short answer is not forfeited), a
    one-token match is not worth a verification pass that costs 1.7 steps."""
    auto = AutoGamma(q41_cost())
    assert auto.choose([(40, 32)]) >= 8
    assert auto.choose([(1, 32)]) == 0
    assert auto.choose([(40, 3)]) <= 3  # never more than the proposal holds


def test_history_of_whole_copies_takes_long_proposals_and_rejections_shrink_them():
    auto = AutoGamma(q41_cost())
    for _ in range(30):  # 32-token copies accepted whole
        auto.observe(32, 32, match=40)
    assert auto.choose([(40, 32)]) >= 16
    for _ in range(100):  # the same matches now fail after 2 tokens (memory: ~30 proposals)
        auto.observe(16, 2, match=40)
    assert auto.choose([(40, 32)]) <= 4
    assert auto.choose([(12, 32)]) == AutoGamma(q41_cost()).choose([(12, 32)]) > 0  # other match lengths: unaffected


def test_short_match_history_that_copies_well_turns_speculation_on():
    auto = AutoGamma(q41_cost())
    assert auto.choose([(2, 32)]) == 0
    for _ in range(40):
        auto.observe(8, 8, match=2)
    assert auto.choose([(2, 32)]) >= 4


def test_batched_iterations_shrink_gamma_then_stop():
    """T(B, k) priced from the single-row T(B·k): the same copy is worth less as the batch fills; a
    refined T(B, k) from real batched iterations moves the choice."""
    cost = CostModel([0.0086 * r for r in Q41])
    auto = AutoGamma(cost)
    for _ in range(30):  # copies accepted for half their 16 tokens: α ≈ 0.89
        auto.observe(16, 8, match=20)
    rows = [(20, 32)]
    widths = [auto.choose(rows * b, b) for b in (1, 2, 4, 6, 8)]
    assert widths == sorted(widths, reverse=True) and widths[0] >= 3 and widths[-1] == 0, widths
    for _ in range(20):  # this machine turns out to batch for free
        cost.observe_target(5, cost.seconds(1, 8), batch=8)
        cost.observe_target(1, cost.seconds(1, 8), batch=8)
    assert cost.batch.observations[(8, 5)] == 20 and auto.choose(rows * 8, 8) >= 4


def test_unpadded_passes_follow_llama_cpps_split():
    """A run of adjacent rows with tokens left shares a pass, as many tokens each as its shortest has."""
    assert passes([1] * 5) == [(5, 1)]
    assert passes([3, 3, 3]) == [(3, 3)]
    assert passes([5, 1, 1, 1]) == [(4, 1), (1, 4)]
    assert passes([5, 1, 5, 5]) == [(4, 1), (1, 4), (2, 4)]
    assert passes([2, 4, 1]) == [(3, 1), (2, 1), (1, 2)]


def test_ragged_batches_give_each_row_its_own_gamma():
    """On a ragged target (batched llama.cpp: rows scored unpadded) a row inside a long copy speculates
    while the rows beside it, with nothing to copy, score one token each; on a padded target the same
    batch decodes plainly (every row would pay the copy's width). Real iterations price batched plain
    and what speculation adds: where that turns out dear, no row speculates."""
    padded, ragged = CostModel([0.0086 * r for r in Q41]), CostModel([0.0086 * r for r in Q41], ragged=True)
    autos = [AutoGamma(padded), AutoGamma(ragged)]
    for auto in autos:
        auto.observe_step(1, 0.052, batch=8)  # 8 rows' plain step: 6.5 ms a row (seen here: 7-8)
        for _ in range(30):  # copies at match length 20 accepted whole
            auto.observe(16, 16, match=20)
    assert ragged.batch.plain[8] == 0.052 and ragged.seconds(1, 8) == 0.052
    lone = [(20, 32)] + [(None, 0)] * 7
    assert autos[0].choose(lone, 8) == 0
    widths = ragged_widths(ragged, autos[1].alphas(lone), [1] * 8, 1.05)
    assert widths[0] >= 8 and widths[1:] == [0] * 7, widths
    two = ragged_widths(ragged, autos[1].alphas([(20, 32), (5, 32)] + [(None, 0)] * 6), [1] * 8, 1.05)
    assert two[0] > two[1] and two[2:] == [0] * 6, two  # the likelier copy gets more drafts
    apart = ragged_widths(ragged, autos[1].alphas([(20, 32), (None, 0), (20, 32)] + [(None, 0)] * 5), [1] * 8, 1.05)
    assert sum(map(bool, apart)) == 1 or apart[0] == apart[2], apart  # two rows apart: two passes, priced
    for _ in range(30):  # a row's 4 drafts (a one-row pass: T(4) priced) cost as much as the plain step
        ragged.observe_target(5, 0.104, batch=8, lengths=[5] + [1] * 7)
    assert ragged.batch.extra == pytest.approx(0.052 / ragged.target_s[3], rel=0.01)
    assert ragged_widths(ragged, autos[1].alphas(lone), [1] * 8, 1.05) == [0] * 8


def test_a_batch_that_ends_with_its_last_row_prices_drafts_by_what_they_save_it():
    """`left` given (an offline batch, nothing queued): a lone row's copy saves that row's share of the
    plain passes to come, not whole passes, while the other rows still have as far to go; it pays where
    that row is the one the batch waits for, or where every row copies. Without `left` (a server: each
    request waits for its own row) the lone copy pays as before."""
    ragged = CostModel([0.0086 * r for r in Q41], ragged=True)
    auto = AutoGamma(ragged)
    auto.observe_step(1, 0.035, batch=8)  # 8 rows' plain step: T(1) + 7 rows of ~3.8 ms (seen here: 3.7)
    for _ in range(30):
        auto.observe(16, 16, match=20)
    lone = auto.alphas([(20, 32)] + [(None, 0)] * 7)
    assert ragged_widths(ragged, lone, [1] * 8, 1.05)[0] >= 8  # a server's request: its own tokens
    assert ragged_widths(ragged, lone, [1] * 8, 1.05, left=[100] * 8) == [0] * 8  # no pass saved
    ahead = ragged_widths(ragged, lone, [1] * 8, 1.05, left=[100] + [3] * 7)
    assert ahead[0] >= 8 and ahead[1:] == [0] * 7, ahead  # the row the batch waits for
    every = ragged_widths(ragged, auto.alphas([(20, 32)] * 8), [1] * 8, 1.05, left=[100] * 8)
    assert min(every) >= 4, every  # all rows copy: the batch's passes shrink
    value = batch_value(ragged, [100] * 8)
    assert value([1.0] * 8) == pytest.approx(ragged.seconds(1, batch=8))  # a plain iteration is worth its cost
    per_row = (0.035 - ragged.seconds(1)) / 7
    assert value([5.0] + [1.0] * 7) - value([1.0] * 8) == pytest.approx(4 * per_row)


@pytest.mark.usefixtures("one_thread")
def test_engine_keeps_what_it_learned_across_requests(tiny_target):
    """Acceptance by match length and T(k) live on the Engine: the second request's policy starts from
    the first one's history (server, generate_batch and bench all go through `drafting`)."""
    engine = Engine(tiny_target, None, "prompt-lookup", "auto")
    engine.drafts.learned._target_costs, engine.drafts.learned._target_observations = [0.01 * (1 + 0.5 * k) for k in range(33)], [0] * 33
    _, first = engine.drafting("auto")
    for _ in range(10):
        first.observe(32, 32, match=40)
        first.observe_step(33, 0.05)
        first.observe_step(1, 0.01)  # a wide pass is observed with the step after it
    _, second = engine.drafting("auto")
    assert second.acceptance.shared is first.acceptance.shared and second.cost is first.cost  # a view per request
    assert second.acceptance is not first.acceptance
    assert second.acceptance.alpha(40) > 0.99 and second.cost.target_observations[32] == 10


def test_a_batch_calls_prompts_learn_from_one_another(embedded, monkeypatch):
    """`generate_batch`: every prompt's rows price their copies by ONE view of the acceptance (the call's
    `Request.views`): a batch whose first copies fail stops drafting within a few proposals, where rows
    that each learnt alone met the history's α one by one. Two calls, or two lone requests, do not share."""
    views = []  # each generation's acceptance view

    def policy(*args):
        drafter, gamma = real(*args)
        views.append(gamma.acceptance)
        return drafter, gamma
    real = embedded.drafts.policy
    monkeypatch.setattr(embedded.drafts, "policy", policy)
    prompts = ["Name a fruit.", "Name a tree.", "Name a river."]
    kw = dict(max_new_tokens=4, temperature=0, gamma="auto", draft="prompt-lookup")
    for _ in range(2):
        embedded.generate_batch(prompts, **kw)
    embedded.generate(prompts[0], **kw)
    embedded.generate(prompts[0], **kw)
    first, second, lone, other = views[:3], views[3:6], views[6], views[7]
    assert all(v is first[0] for v in first) and all(v is second[0] for v in second) and first[0] is not second[0]
    assert lone is not other and lone is not first[0] and lone.shared is first[0].shared  # one engine's history
    assert first[0].cautious and second[0].cautious and not lone.cautious  # short matches: the batch's own to earn
