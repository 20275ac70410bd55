"""The paper calculator (Table 1), the cost-model arithmetic and the auto-gamma policy — injected
costs, no timing."""

from __future__ import annotations

import pytest

from exactspec.speculative import theory
from exactspec.autogamma.policy import AutoGamma
from exactspec.autogamma.costs import CostModel, DepthCosts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("alpha,gamma,ops,walltime", theory.PAPER_TABLE_1)
def test_paper_table_1(alpha, gamma, ops, walltime):
    assert round(theory.arithmetic_factor(alpha, gamma), 2) == ops
    assert round(theory.walltime_factor(alpha, gamma), 2) == walltime


def test_expected_tokens_edges():
    assert theory.expected_tokens(0.0, 5) == 1.0
    assert theory.expected_tokens(1.0, 5) == 6.0
    assert theory.expected_tokens(0.5, 0) == 1.0
    with pytest.raises(ValueError):
        theory.expected_tokens(1.5, 2)


def test_optimal_gamma_grows_with_alpha_and_shrinks_with_cost():
    assert theory.optimal_gamma(0.9, c=0.01) > theory.optimal_gamma(0.6, c=0.01) >= 1
    assert theory.optimal_gamma(0.8, c=0.5) < theory.optimal_gamma(0.8, c=0.05)
    assert theory.optimal_gamma(0.1, c=1.0) == 0


def test_flat_costs_reduce_to_theorem_3_8():
    cost = CostModel(target_s=[0.1] * 9, draft_s_per_token=0.01)  # c = 0.1, T flat
    for alpha in (0.3, 0.6, 0.9):
        for gamma in range(9):
            assert cost.predicted_speedup(alpha, gamma) == pytest.approx(theory.walltime_factor(alpha, gamma, 0.1))


def test_rising_verification_cost_lowers_prediction():
    cost = CostModel(target_s=[0.1, 0.2, 0.3, 0.4], draft_s_per_token=0.0)  # T(k) = k · T(1)
    # emitting E tokens per iteration costs T(γ+1) = (γ+1) steps: speculation can never win
    assert cost.predicted_speedup(0.9, 3) == pytest.approx(theory.expected_tokens(0.9, 3) / 4)
    assert cost.best_gamma(0.99) == 0
    assert cost.step_cost(2) == pytest.approx(3.0)


def test_best_gamma_uses_measured_costs():
    cost = CostModel(target_s=[0.05, 0.055, 0.06, 0.09, 0.092, 0.094, 0.097], draft_s_per_token=0.0)
    assert cost.best_gamma(0.05) == 0
    assert cost.best_gamma(0.5) == 2  # before the jump at k=4
    assert cost.best_gamma(0.95) == 6


def test_auto_picks_zero_when_costs_say_speculation_loses():
    auto = AutoGamma(CostModel(target_s=[0.05, 0.1, 0.15], draft_s_per_token=0.0), prior_alpha=0.9)
    choices = [auto.next_gamma() for _ in range(100)]
    assert choices.count(0) >= 95  # only sparse γ=1 probes
    assert choices[:7] == [0] * 7


def test_auto_backs_off_after_rejections_and_probes_rarely():
    auto = AutoGamma(CostModel(target_s=[0.05, 0.06, 0.065, 0.07], draft_s_per_token=0.0), prior_alpha=0.5)
    assert auto.next_gamma() == 2
    for _ in range(20):  # every proposal rejected at once
        auto.observe(3, 0)
    choices = []
    for _ in range(200):
        g = auto.next_gamma()
        choices.append(g)
        if g:
            auto.observe(g, 0)
    assert sum(1 for g in choices if g) <= 5  # probes at 8, 16, 32, 64, 128 steps


def test_auto_recovers_when_drafts_are_accepted():
    auto = AutoGamma(CostModel(target_s=[0.05, 0.06, 0.07, 0.08], draft_s_per_token=0.0), prior_alpha=0.05)
    assert auto.next_gamma() == 0
    for _ in range(10):
        auto.observe(3, 3)
    assert auto.next_gamma() == 3 and auto.alpha > 0.8


def test_auto_in_the_loop_is_exact_at_greedy(tiny_target):
    import torch

    from exactspec.speculative.loop import decode
    from exactspec.drafters.suffix import PromptLookupDrafter
    from exactspec.speculative.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    prompt = [3, 5, 2, 3, 5, 7, 2]
    plain = list(decode(tiny_target, None, prompt, greedy, 0, 30))
    auto = AutoGamma(CostModel(target_s=[0.05, 0.051, 0.052, 0.053], draft_s_per_token=0.0), prior_alpha=0.5)
    assert list(decode(tiny_target, PromptLookupDrafter(), prompt, greedy, auto, 30, torch.Generator())) == plain


def test_auto_needs_a_margin_before_speculating():
    cost = CostModel(target_s=[0.05, 0.0505, 0.051], draft_s_per_token=0.0)
    assert cost.best_gamma(0.02) > 0 and cost.predicted_speedup(0.02, cost.best_gamma(0.02)) < 1.05
    assert AutoGamma(cost, prior_alpha=0.02, prior_strength=1000).next_gamma() == 0
    assert AutoGamma(cost, prior_alpha=0.5).next_gamma() == 2


def test_auto_corrects_a_wrong_draft_cost_from_real_proposals():
    cost = CostModel(target_s=[0.05, 0.0505, 0.051, 0.0515], draft_s_per_token=1.0)  # a bad one-off reading
    auto = AutoGamma(cost, prior_alpha=0.6)
    assert auto.next_gamma() == 0
    auto.observe(1, 1, draft_s=0.0001)  # a probe's real drafting time
    assert cost.draft_s_per_token == pytest.approx(0.0001)
    assert auto.next_gamma() == 3


def test_real_iterations_refine_verification_costs():
    """Measured T(k) said speculation pays; real iterations at the user's context say k=2 costs 1.5
    steps: auto stops speculating. T(1) moving moves every T(k) by as much; a wider pass moves what its
    width costs beyond T(1)."""
    cost = CostModel(target_s=[0.010, 0.011, 0.012, 0.013])
    auto = AutoGamma(cost, prior_alpha=0.3, prior_strength=1000)
    assert auto.next_gamma() > 0
    for _ in range(30):
        auto.observe_step(1, 0.012)
        auto.observe_step(2, 0.018)
        auto.observe_step(3, 0.024)
        auto.observe_step(4, 0.030)
    assert cost.ratios()[1] == pytest.approx(1.5, rel=0.01)
    assert auto.next_gamma() == 0
    fresh = CostModel(target_s=[0.010, 0.020, 0.030])
    fresh.observe_target(1, 0.012)  # the first timing replaces the table's T(1); every width pays the change
    assert fresh.target_s == pytest.approx([0.012, 0.022, 0.032])
    fresh.observe_target(1, 0.014)  # the second: half-way (a running mean over the first timings)
    assert fresh.target_s == pytest.approx([0.013, 0.023, 0.033])
    fresh.observe_target(3, 1.0)  # an outlier moves T(3) beyond T(1) by at most 2x, and T(2) half as far
    assert fresh.target_s == pytest.approx([0.013, 0.013 + 0.010 * 1.5, 0.013 + 0.020 * 2])
    fresh.observe_target(3, 1.0)  # its second timing: half-way to 2x again
    assert fresh.target_s[2] == pytest.approx(0.013 + 0.040 * 1.5)
    fresh.observe_target(9, 0.5)  # beyond the measured k: ignored
    frozen = CostModel(target_s=[0.010, 0.020], frozen=True)
    frozen.observe_target(2, 0.015)
    frozen.observe_draft(0.5)
    assert frozen.target_s == [0.010, 0.020] and frozen.draft_s_per_token == 0.0


def test_drafters_share_the_targets_refined_costs(tiny_target):
    """T(k) is the target's: what one drafter's auto-gamma iterations learn, every drafter's uses."""
    from exactspec.engine import Engine

    engine = Engine(tiny_target, None, "prompt-lookup", "auto")
    lookup, bigram = engine.cost_model("prompt-lookup", max_gamma=2), engine.cost_model("bigram", max_gamma=2)
    policy = AutoGamma(lookup)
    policy.observe_step(2, 3 * lookup.target_s[1])
    policy.observe_step(1, 0.5 * lookup.target_s[0])  # a wide pass is observed with the step after it
    assert bigram.target_s is lookup.target_s and bigram.target_observations == [1, 1, 0]
    other = AutoGamma(bigram)
    other.observe_step(1, 2 * lookup.target_s[0])
    other.finish()  # a one-row plain step is kept until the policy prices or its row ends
    assert lookup.target_observations == [2, 1, 0]
    assert bigram.depth is lookup.depth  # T(k) at deeper contexts too
    assert lookup.copies and not bigram.copies  # a lookup is priced per proposal, a bigram per token


def deep_costs(**kw) -> CostModel:
    """Synthetic T(k, depth): at 100 tokens a block of k is nearly free (weights dominate); at 1000 and
    3000 attention over the context makes every pass dearer and each extra token in a block more so."""
    def curve(t1, per_token):
        return [t1 + per_token * (k - 1) for k in range(1, 34)]

    deeper = DepthCosts(100, [1000, 3000], [curve(0.013, 0.0012), curve(0.020, 0.004)])
    return CostModel(curve(0.010, 0.0002), depth=deeper, **kw)


def test_deep_contexts_get_a_smaller_gamma():
    """The same learned α: at 100 tokens long blocks pay, at 3000 (attention makes blocks relatively
    dearer) auto picks a smaller γ; its predictions there use the costs at that depth."""
    cost = deep_costs(frozen=True)
    shallow, deep = cost.best_gamma(0.8, depth=100), cost.best_gamma(0.8, depth=3000)
    assert 0 < deep < shallow
    assert cost.best_gamma(0.8) == shallow  # no depth: the base measurement's (as before depths existed)
    auto = AutoGamma(cost, prior_alpha=0.8, prior_strength=1000)
    assert auto.next_gamma(depth=3000) == deep < auto.next_gamma(depth=100) == shallow
    auto.depth = 3000  # what propose.py sets from the row's context
    assert auto.next_gamma() == deep and auto.choose([(None, 32)]) == deep
    assert auto.best([(None, 32)])[1] == pytest.approx(cost.predicted_speedup(0.8, deep, depth=3000))


def test_prediction_interpolates_costs_in_depth():
    cost = deep_costs(frozen=True)
    # 550 tokens: halfway between the 100 and 1000 curves
    t = [(0.010 + 0.0002 * (k - 1) + 0.013 + 0.0012 * (k - 1)) / 2 for k in range(1, 34)]
    assert [cost.target_seconds(k, 550) for k in range(1, 34)] == pytest.approx(t)
    assert cost.seconds(5, depth=550) == pytest.approx(t[4])
    assert cost.predicted_speedup(0.7, 4, depth=550) == pytest.approx(theory.expected_tokens(0.7, 4) / (t[4] / t[0]))
    assert cost.step_cost(4, depth=2000) == pytest.approx((0.5 * (0.013 + 0.0048) + 0.5 * (0.020 + 0.016))
                                                          / (0.5 * 0.013 + 0.5 * 0.020))
    for depth in (None, 550, 2000, 5000):  # auto γ's scan prices the plain step once: the same numbers, exactly
        assert cost.step_costs(32, depth=depth) == [cost.step_cost(g, depth=depth) for g in range(33)]
    assert cost.step_costs(8, batch=3) == [cost.step_cost(g, 3) for g in range(9)]  # batched: the same formula
    for depth in (None, 50, 550, 2000, 5000):  # one k at a depth (each iteration's): the curve's own numbers
        assert [cost.target_seconds(k, depth) for k in range(1, 34)] == cost.target_curve(33, depth)
    assert cost.target_seconds(3, 50) == cost.target_seconds(3, 100) == cost.target_s[2]  # shallower: the base
    # past the deepest: linear in depth, between flat and proportional to it
    assert cost.target_seconds(1, 5000) == pytest.approx(0.020 + 2000 * (0.020 - 0.013) / 2000)
    assert cost.target_seconds(1, 3000) <= cost.target_seconds(1, 10**6) <= 0.020 * 10**6 / 3000
    flat = CostModel([0.01, 0.02], depth=DepthCosts(100, [1000], [[0.01, 0.02]]), frozen=True)
    assert flat.target_seconds(2, 9000) == pytest.approx(0.02)  # never cheaper than the deepest measured


def test_iterations_refine_the_depths_around_them():
    """A real one-row iteration moves the measured depths around its own, by their share of the
    interpolation; at the base depth (or with no depth known) exactly as before depths existed. A wider
    pass moves what its width costs beyond T(1); a one-token step moves every width by as much."""
    cost = deep_costs()
    before = [list(c) for _, c, _, _ in cost._curves()]
    extra = lambda curve, k: curve[k - 1] - curve[0]  # noqa: E731
    one = cost.target_seconds(1, 1000)
    cost.observe_target(3, one + 2 * extra(before[1], 3), depth=1000)  # at a measured depth: it alone
    after = [c for _, c, _, _ in cost._curves()]
    assert extra(after[1], 3) == pytest.approx(extra(before[1], 3) * 2)  # a first timing: as timed
    assert after[1][0] == before[1][0] and after[0] == before[0] and after[2] == before[2]
    assert cost.depth.observations[0][2] == 1 and cost.target_observations[2] == 0
    one = cost.target_seconds(1, 2000)
    cost.observe_target(3, one + 2 * (cost.target_seconds(3, 2000) - one), depth=2000)  # halfway: half the step each
    assert extra(after[1], 3) == pytest.approx(extra(before[1], 3) * 2 * 1.25)  # its 2nd timing, half-weighted
    assert extra(after[2], 3) == pytest.approx(extra(before[2], 3) * 1.5)  # its 1st, half-weighted
    assert extra(after[2], 4) == pytest.approx(extra(before[2], 4) * 1.25)  # a width near 3: half as far
    assert extra(after[2], 8) == extra(before[2], 8)  # beyond NEAR: untouched
    held, t1 = list(cost.depth.seconds[1]), cost.depth.seconds[1][0]
    cost.observe_target(1, 0.5 * t1, depth=3000)  # T(1) at 3000 (its first timing) moves every width there by as much
    assert cost.depth.seconds[1] == pytest.approx([t - 0.5 * t1 for t in held])
    # a width no pass has timed yet is priced with its extra scaled as T(1) fell since the table (0.5x);
    # one a pass timed (width 3, at 2000 tokens) is priced as timed
    one = cost.target_seconds(1, 3000)
    assert cost.target_seconds(8, 3000) - one == pytest.approx(extra(held, 8) * 0.5)
    assert cost.target_seconds(3, 3000) - one == pytest.approx(extra(held, 3))
    one = cost.target_seconds(1, 9000)
    cost.observe_target(2, one + 2 * (cost.target_seconds(2, 9000) - one), depth=9000)  # past the deepest: the deepest
    assert extra(cost.depth.seconds[1], 2) == pytest.approx(extra(held, 2) * 0.5 * 2)  # as priced, then as timed
    base = list(cost.target_s)
    policy = AutoGamma(cost)
    policy.observe_step(1, 0.5 * base[0])  # no depth: the base curve, as before
    policy.finish()
    assert cost.target_s == pytest.approx([t - 0.5 * base[0] for t in base])
    assert "depths" in cost.to_dict() and set(cost.to_dict()["depths"]) == {"100", "1000", "3000"}


def test_a_width_costs_what_it_adds_to_a_step():
    """The two parts of T(k) drift apart on a shared machine (measured on a 2-core VM: T(1) moved
    between ~4 and ~8 ms while T(8) stayed at ~25 ms). A table measured in the slow state, then one-token
    steps in the fast one: T(1) follows them, and an 8-token pass is priced optimistically (its extra over
    T(1) scaled down with T(1), never up) until 8-token passes are timed: then at what they take."""
    cost = CostModel(target_s=[0.008, 0.011, 0.014, 0.016, 0.019, 0.021, 0.023, 0.025])
    for _ in range(40):
        cost.observe_target(1, 0.004)
    assert cost.target_seconds(1) == pytest.approx(0.004, rel=0.01)
    assert cost.target_seconds(8) == pytest.approx(0.004 + 0.017 / 2, rel=0.02)  # the extra, halved with T(1)
    for _ in range(40):  # 8-token passes that cost 0.038: the width's part, as measured (clipped per pass)
        cost.observe_target(8, 0.004 + 2 * 0.017)
    assert cost.target_seconds(8) == pytest.approx(0.004 + 2 * 0.017, rel=0.01)
    assert cost.target_seconds(1) == pytest.approx(0.004, rel=0.01)
    assert cost.curves()[0][7] == pytest.approx(cost.target_seconds(8))  # what a later start begins from


def test_a_noisy_t1_does_not_ratchet_timed_extras_down():
    """T(1) wanders from step to step on a shared machine while an extra row's compute holds. Extras once
    timed are priced as timed: were each dip of T(1) to scale them down (never up), every wide pass
    would begin from the lowest and the extras would sink below their cost (measured in the loop: 8-token
    passes priced at half what they took, so chat and paraphrases drafted at a loss)."""
    true_extra = [0.0015 * (k - 1) for k in range(1, 17)]  # [K]: what each width adds, steady
    cost = CostModel(target_s=[0.004 + e for e in true_extra])
    for i in range(400):
        cost.observe_target(1, 0.004 * (0.8 if i % 2 else 1.2))  # T(1) 3.2 or 4.8 ms, by turns
        if i % 5 == 0:
            k = 2 + i % 7  # widths 2..8 by turns, each taking T(1) + its extra
            cost.observe_target(k, cost.target_seconds(1) + true_extra[k - 1])
    for k in range(2, 9):
        priced = cost.target_seconds(k) - cost.target_seconds(1)
        assert priced == pytest.approx(true_extra[k - 1], rel=0.05), (k, priced, true_extra[k - 1])


def test_a_stale_table_heals_because_wide_passes_look_cheap_not_dear():
    """A table measured while the machine was slow (every T(k) twice today's): one-token steps bring T(1)
    down, and the wide passes must not keep their slow extras (priced dear, they were never chosen, so
    never timed again: the embedded demo then drafted 3 tokens in 97 steps). Priced with the extras scaled
    down as T(1) fell, a copy pays again at once; T(1) rising never raises an extra (its passes, chosen,
    are timed)."""
    today = [0.005 + 0.0015 * k for k in range(33)]
    cost = CostModel(target_s=[2 * t for t in today], copies=True)
    auto = AutoGamma(cost)
    copy = [(12, 32, ("context", "greedy"))]  # a 12-token match into a copy of the prompt
    fresh = AutoGamma(CostModel(target_s=list(today), copies=True)).choose(copy)
    assert fresh > 2
    for _ in range(60):
        cost.observe_target(1, today[0])
    assert cost.target_seconds(1) == pytest.approx(today[0], rel=0.01)
    assert auto.choose(copy) == fresh  # the ratios as measured, not T(k) - T(1) of the slow table
    slow = CostModel(target_s=list(today))
    for _ in range(60):
        slow.observe_target(1, 2 * today[0])
    assert slow.target_seconds(9) == pytest.approx(2 * today[0] + today[8] - today[0], rel=0.01)  # extra kept


def test_a_drafter_slower_than_its_gain_gets_gamma_zero():
    """The drafter's own time is priced as measured per iteration: a copying drafter by its seconds per
    proposal (whatever γ is kept), a model drafter per drafted token; when it exceeds what the drafts
    save, γ = 0."""
    copy = (20, 32, ("context", "greedy"))  # a 20-token match, 32 tokens to copy
    cheap = AutoGamma(CostModel([0.010 + 0.0002 * k for k in range(33)], copies=True, draft_s_per_step=0.0001))
    assert cheap.choose([copy]) > 4
    slow = AutoGamma(CostModel([0.010 + 0.0002 * k for k in range(33)], copies=True, draft_s_per_step=0.0001))
    slow.observe(8, 8, draft_s=0.5, match=20, kind=("context", "greedy"))  # an iteration's lookup took 0.5 s
    assert slow.cost.draft_s_per_step == pytest.approx(0.5)
    assert slow.choose([copy]) == 0 and slow.best([copy])[0] == 0 and slow.speedup([copy], 32) < 1.0
    lookup = CostModel([0.010 + 0.0002 * k for k in range(33)], copies=True, draft_s_per_step=0.03)
    assert lookup.draft_seconds(1) == lookup.draft_seconds(32) == 0.03 and lookup.draft_seconds(0) == 0.0
    model = AutoGamma(CostModel([0.010 + 0.0002 * k for k in range(33)], draft_s_per_token=0.0001), prior_alpha=0.8)
    assert model.next_gamma() > 0
    model.observe(4, 4, draft_s=0.08)  # 20 ms a token: more than a target step saves
    assert model.cost.draft_seconds(3) == pytest.approx(0.06) and model.next_gamma() == 0
    deep = deep_costs(copies=True, draft_s_per_step=0.006)  # the same lookup: pays shallow, not deep
    auto = AutoGamma(deep, prior_alpha=0.5, prior_strength=1000)
    assert auto.next_gamma(depth=100) > 0 and auto.next_gamma(depth=3000) == 0


def test_the_loop_prices_auto_at_the_rows_depth(tiny_target):
    """propose.py gives auto the row's context depth each iteration: its choices and what it learns
    from the iteration's timing are at that depth; greedy output is unchanged."""
    import torch

    from exactspec.drafters.suffix import PromptLookupDrafter
    from exactspec.speculative.loop import decode
    from exactspec.speculative.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    prompt = [3, 5, 2, 3, 5, 7, 2] * 3
    plain = list(decode(tiny_target, None, prompt, greedy, 0, 30))
    cost = CostModel([0.05, 0.051, 0.052, 0.053], depth=DepthCosts(4, [40], [[0.05, 0.06, 0.07, 0.08]]))
    auto = AutoGamma(cost, prior_alpha=0.5)
    assert list(decode(tiny_target, PromptLookupDrafter(), prompt, greedy, auto, 30, torch.Generator())) == plain
    assert len(prompt) <= auto.depth < len(prompt) + 30
    assert sum(cost.depth.observations[0]) > 0  # iterations at 21..50 tokens refined the 40-token curve


def test_a_batch_whose_copies_do_not_pay_rests_from_drafting():
    """AutoGamma.resting: after a batch iteration whose copies were all cut to nothing, the batch sits
    out 1, then 2, 4, ... up to MAX_REST iterations; an iteration that drafted starts the gap over."""
    from exactspec.autogamma.policy import MAX_REST

    auto = AutoGamma(CostModel(target_s=[0.05, 0.06, 0.07], draft_s_per_token=0.0))

    def rests_after_a_miss() -> int:
        auto.batch_drafted(False)
        n = 0
        while auto.resting():
            n += 1
        return n

    assert not auto.resting()  # a new policy looks at once
    assert [rests_after_a_miss() for _ in range(6)] == [1, 2, 4, 8, MAX_REST, MAX_REST] and MAX_REST == 8
    auto.batch_drafted(True)
    assert not auto.resting() and rests_after_a_miss() == 1


@pytest.mark.parametrize("seed", range(4))
def test_one_rows_width_scan_equals_the_full_scan(seed):
    """`best` for one row stops its scan where no wider width can win (E[tokens] < 1/(1-α), against the
    least cost from there on): the same width and the same predicted speed-up as pricing every width
    (`speedup`), on cost curves that are not monotone, at α 0 and 1, short and long proposals."""
    import random

    rng = random.Random(seed)
    curve = sorted(rng.uniform(0.01, 0.05) for _ in range(33))
    for _ in range(4):  # measured curves wobble
        i = rng.randrange(1, 32)
        curve[i], curve[i + 1] = curve[i + 1], curve[i]
    cost = CostModel(curve, draft_s_per_step=rng.uniform(0, 0.002), copies=True, frozen=True)
    for alpha in (0.0, 0.05, 0.3, 0.5, 0.7, 0.9, 0.97, 1.0):
        auto = AutoGamma(cost, prior_alpha=alpha, prior_strength=1e9)
        for avail in (1, 2, 5, 32):
            widths = [auto.speedup([(None, avail)], g) for g in range(avail + 1)]
            top = max(widths)
            assert auto.best([(None, avail)]) == (widths.index(top), top), (alpha, avail)


def test_a_lookup_skips_match_lengths_that_cannot_pay():
    """`shortest_paying`: the shortest match whose copy auto γ predicts to pay (so a lookup need not
    look for shorter ones); every length while a probe is due, so that a short match can win back."""
    cost = CostModel([0.010, 0.014, 0.019, 0.020] + [0.02 + 0.002 * k for k in range(30)], copies=True)
    auto = AutoGamma(cost, first_probe=4)
    kinds = [("context", "greedy")]
    assert auto.shortest_paying(kinds) == 1  # the priors: a one-token match pays
    for _ in range(30):  # one- and two-token matches keep failing
        auto.observe(1, 0, match=1, kind=kinds[0])
        auto.observe(2, 0, match=2, kind=kinds[0])
    assert auto.shortest_paying(kinds) == 3 and auto.shortest_paying(kinds, longest=5) == 3
    auto.observe(3, 0, match=3, kind=kinds[0])
    auto.observe(3, 0, match=4, kind=kinds[0])
    assert auto.shortest_paying(kinds) == 3  # the longest order is always looked up
    assert auto.shortest_paying(kinds + [("store", "greedy")]) == 3
    for _ in range(3):  # copies found but not paying: plain steps towards the next probe
        assert auto.choose([(3, 5, kinds[0])]) == 0
    assert auto.shortest_paying(kinds) == 1  # a probe is due: look for every length
    assert auto.choose([(1, 5, kinds[0])]) == 1
    # the answer is priced again after this policy's outcomes (above), and every REPRICE calls: another
    # request's policy sharing the acceptance shows here within REPRICE lookups
    from exactspec.autogamma.policy import REPRICE

    other = AutoGamma(cost, acceptance=auto.acceptance)
    for _ in range(40):
        other.observe(1, 1, match=1, kind=kinds[0])
    answers = [auto.shortest_paying(kinds) for _ in range(REPRICE + 1)]
    assert answers[0] == 3 and answers[-1] == 1


def test_the_shortest_paying_match_is_the_shortest_bucket_whose_best_width_pays():
    """`shortest_paying` prices each bucket's shortest match inline: the same answer as asking `best` for
    a copy of every length in turn, over random curves and outcomes (no probe due)."""
    import random

    from exactspec.autogamma.acceptance import BUCKET_EDGES

    rng = random.Random(0)
    kinds = [("context", "greedy"), ("store", "greedy")]
    answers = set()
    for _ in range(300):
        t1, slope = rng.uniform(0.004, 0.01), rng.uniform(0.05, 1.5)
        curve = [t1 * (1 + sum(rng.uniform(0.0, slope) for _ in range(k))) for k in range(33)]
        auto = AutoGamma(CostModel(curve, copies=True, frozen=True), first_probe=10**9)
        for _ in range(rng.randrange(40)):
            match = rng.choice(BUCKET_EDGES)
            auto.observe(4, rng.randrange(5), match=match, kind=rng.choice(kinds))
        asked = kinds[: rng.randrange(1, 3)]
        longest = rng.choice((3, 5, 64))
        reference = next((m for m in BUCKET_EDGES if m < longest and any(
            auto.best([(m, auto.max_gamma, kind)], 1)[1] >= auto.min_gain for kind in asked)), longest)
        assert auto.shortest_paying(asked, longest) == reference
        answers.add(reference)
    assert {1, 2, 3, 5, 9, 17} <= answers  # short and long matches, and none (3, 5: the longest asked), priced


def test_the_store_starts_from_a_lower_prior():
    """The store (other requests' text) is a weaker witness than the request's own context at the same
    match length: a cold engine's store copies of short matches are not drafted before they are seen to pay."""
    from exactspec.autogamma.acceptance import BUCKET_EDGES, COPY_PRIOR, STORE_PRIOR, Acceptance

    seen = Acceptance()
    for b, match in enumerate(BUCKET_EDGES):  # the shortest match of each bucket
        context, store = seen.of(("context", "greedy")).alpha(match), seen.of(("store", "greedy")).alpha(match)
        assert (context, store) == pytest.approx((COPY_PRIOR[b], STORE_PRIOR[b])) and store < context
    assert seen.of(("store", "sampled")).alpha(1) == pytest.approx(STORE_PRIOR[0])


def test_a_model_arms_width_is_best_at_its_alpha_and_kept_until_an_outcome():
    """`model_width`: `best`'s width for a model drafter's one α where it pays by min_gain (else 0), for
    proposals of at most k tokens; the same answer until this policy hears an outcome or REPRICE calls pass."""
    cost = CostModel([0.010 + 0.001 * k for k in range(33)], draft_s_per_token=0.0001, frozen=True)
    auto = AutoGamma(cost, prior_alpha=0.8, prior_strength=100)
    kind = ("bigram", "greedy")
    wide = auto.best([(None, 32, kind)], 1)[0]
    assert wide > 3 and auto.model_width(kind, 32) == wide
    assert auto.model_width(kind, 3) == auto.best([(None, 3, kind)], 1)[0] == 3  # a short budget
    for _ in range(400):  # outcomes heard elsewhere (the shared acceptance) wait for the re-pricing
        auto.acceptance.of(kind).observe(4, 0)
    assert auto.model_width(kind, 32) == wide
    auto.observe(4, 0, kind=kind)  # this policy's own outcome: priced again
    assert auto.model_width(kind, 32) == 0 and auto.best([(None, 32, kind)], 1)[1] < auto.min_gain


def test_probes_are_scheduled_across_an_engines_requests(tiny_target):
    """`Probes`: a request's policy probes after the gap its engine's earlier requests left (not from 8
    again), the gap doubling after each probe up to MAX_PROBE_GAP; a policy of its own starts at `first_probe`."""
    from exactspec.engine import Engine
    from exactspec.autogamma.policy import MAX_PROBE_GAP, Probes

    losing = CostModel(target_s=[0.05, 0.1, 0.15], frozen=True)

    def probe_steps(auto: AutoGamma, steps: int) -> list[int]:
        return [i for i in range(steps) if auto.choose([(1, 2)])]

    assert probe_steps(AutoGamma(losing, first_probe=3), 25) == [2, 8, 20]  # gaps 3, 6, 12
    shared = Probes(gap=4)
    assert probe_steps(AutoGamma(losing, probes=shared), 5) == [3]
    assert probe_steps(AutoGamma(losing, probes=shared), 12) == [6]  # the next request goes on: gap 8, 1 step in
    schedule = Probes(gap=MAX_PROBE_GAP)
    steps = probe_steps(AutoGamma(losing, probes=schedule), 2 * MAX_PROBE_GAP)
    assert steps == [MAX_PROBE_GAP - 1, 2 * MAX_PROBE_GAP - 1]  # capped: no wider gap
    waiting = Probes(gap=4)
    for _ in range(10):  # steps that skip their lookup count, but the probe waits for one that looks up
        waiting.skipped()
    assert waiting.due and waiting.plain_steps == 3 and waiting.plain() and waiting.gap == 8
    engine = Engine(tiny_target, None, "prompt-lookup", "auto")
    _, first = engine.drafting()
    _, second = engine.drafting()
    assert first.probes is second.probes and first.acceptance.shared is second.acceptance.shared  # each its own view


def test_a_wide_pass_pays_for_the_slower_step_after_it():
    """llama.cpp rebuilds its graph when the pass shape changes, so the one-token step after a wide pass
    takes longer than the steps between steps. That cost is the wide pass's: T(1) stays what steps after
    steps take, and T(4) learns the pass plus what the step after it took beyond T(1) (timed alone, the
    extra went to T(1), where no choice of γ saw it)."""
    cost = CostModel(target_s=[0.004 + 0.002 * k for k in range(8)])
    auto = AutoGamma(cost)
    for _ in range(60):
        for _ in range(5):
            auto.observe_step(1, 0.004)
        auto.observe_step(4, 0.010)  # 6 ms beyond T(1)...
        auto.observe_step(1, 0.006)  # ...and 2 ms more in the step after it
    assert cost.target_seconds(1) == pytest.approx(0.004, rel=0.01)
    assert cost.target_seconds(4) == pytest.approx(0.012, rel=0.02)


def test_a_short_answers_steps_reach_the_shared_t1_when_it_ends(tiny_target):
    """The loop tells a row's policy that its generation ended (`GammaPolicy.finish`): an answer shorter
    than FOLD steps, with no pricing after its last step, still refines T(1) by every step it took."""
    import torch

    from exactspec.drafters.suffix import PromptLookupDrafter
    from exactspec.autogamma.policy import FOLD
    from exactspec.speculative.loop import decode
    from exactspec.speculative.sampling import SamplingParams
    from exactspec.stats import Stats

    cost = CostModel([0.05 * k for k in range(1, 34)], copies=True)  # a draft never pays: every step plain
    stats = Stats()
    tokens = list(decode(tiny_target, PromptLookupDrafter(), [1, 2, 3, 4], SamplingParams(temperature=0),
                         AutoGamma(cost, first_probe=10**6), FOLD - 3, torch.Generator(), stats, stop_on_eos=False))
    assert len(tokens) == FOLD - 3 and stats.proposed == 0
    assert cost.target_observations[0] == stats.target_calls == FOLD - 3


def test_a_resting_batch_and_a_rows_spacing_wait_side_by_side():
    """propose: a batch's rest (`AutoGamma.resting`, after its copies were cut to nothing) counts the
    iterations while a row's own spacing (`next_lookup`, 2 tokens after a new one where matches of 2+
    pay) runs, not after it: two rows of new tokens look up every rest + 1 iterations (2, 3, 5, 9, 9),
    both in the same iterations, and a rest starts only after an iteration that looked."""
    from exactspec.drafters.suffix import PromptLookupDrafter
    from exactspec.autogamma.policy import MAX_REST
    from exactspec.speculative.propose import propose
    from exactspec.speculative.rows import Row
    from exactspec.speculative.sampling import SamplingParams

    cost = CostModel([1.0 + 0.48 * k for k in range(33)], copies=True, frozen=True, ragged=True)  # 2+ pay
    auto = AutoGamma(cost, first_probe=10**6)
    rows = [Row(j, [1000 * j, 1000 * j + 1], PromptLookupDrafter(), SamplingParams(temperature=0), auto, 10**6, None)
            for j in range(2)]
    looked = []
    for step in range(40):
        before = [row.lookup_at for row in rows]
        propose(rows, 10**6, until_last=True)
        now = [row.lookup_at != at for row, at in zip(rows, before)]  # a row that looks sets its next lookup
        assert now[0] == now[1]
        looked.append(now[0])
        for row in rows:
            row.context.append(row.context[-1] + 2)  # a token never seen before
    at = [i for i, look in enumerate(looked) if look]
    assert auto.shortest_paying([("context", "greedy")], 32) == 2
    assert [b - a for a, b in zip(at, at[1:])][:5] == [2, 3, 5, 1 + MAX_REST, 1 + MAX_REST]


def test_one_row_plain_steps_move_t1_together_before_the_policy_prices():
    """AutoGamma.observe_step keeps a one-row plain step's time (the shared curves untouched) and folds the
    steps kept into T(1), in order, before its next pricing, every FOLD steps, and when a row ends
    (`finish`): T(1) then is what observing each step at once gave."""
    from exactspec.autogamma.policy import FOLD

    def curve() -> CostModel:
        return CostModel([0.010, 0.012, 0.013, 0.020], copies=True)

    times = [0.011, 0.009, 0.014, 0.010, 0.012]
    at_once = curve()
    for seconds in times:
        at_once.observe_target(1, seconds)
    for fold in ("finish", "price"):
        cost = curve()
        auto = AutoGamma(cost)
        for seconds in times:
            auto.observe_step(1, seconds)
        assert cost.target_s == curve().target_s and cost.version == 0  # kept: nothing shared moved
        auto.finish() if fold == "finish" else auto.next_gamma()
        assert cost.target_s == pytest.approx(at_once.target_s, rel=1e-12)
        assert cost.target_observations == at_once.target_observations
    cost = curve()
    auto = AutoGamma(cost)
    for _ in range(FOLD):
        auto.observe_step(1, 0.011)
    assert cost.target_observations[0] == FOLD  # every FOLD steps, with no pricing and no end
    steps = [(0.011, None), (0.013, 40), (0.02, 400), (0.009, 100), (0.012, 2000), (0.011, None)]
    one_by_one, together = deep_costs(), deep_costs()  # base and deeper depths, in one run
    for seconds, depth in steps:
        one_by_one.observe_target(1, seconds, depth=depth)
    together.observe_plain(steps)
    for a, b in zip(one_by_one._curves(), together._curves()):
        assert b[1] == pytest.approx(a[1], rel=1e-12) and b[2] == a[2]
    assert together.version == one_by_one.version
