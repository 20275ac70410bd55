"""The paper calculator (Table 1), the cost-model arithmetic and the auto-gamma policy — injected
costs, no timing."""

from __future__ import annotations

import pytest

from exactspec.speculative import theory
from exactspec.speculative.costmodel import AutoGamma, CostModel

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
    steps: auto stops speculating. T(1) moving carries the unobserved T(k) with it."""
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
    fresh.observe_target(1, 0.012)
    assert fresh.target_s == pytest.approx([0.0104, 0.0208, 0.0312])  # ratios kept until observed
    fresh.observe_target(3, 1.0)  # an outlier moves T(3) by at most TARGET_WEIGHT of 2x
    assert fresh.ratios() == pytest.approx([1.0, 2.0, 3.0 * 1.2])
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
    AutoGamma(lookup).observe_step(2, 3 * lookup.target_s[1])
    assert bigram.target_s is lookup.target_s and bigram.target_observations == [0, 1, 0]
    AutoGamma(bigram).observe_step(1, 2 * lookup.target_s[0])
    assert lookup.target_observations == [1, 1, 0]


def test_target_costs_are_measured_once_per_machine_and_model(tiny_target, tmp_path, monkeypatch):
    """auto γ's T(k) for an adapter whose loader keyed it (`cost_key`) is measured once, then read back from
    the cache (a new engine, a new process: the same file); an unkeyed adapter is measured every time;
    a corrupt entry is measured again."""
    from exactspec import drafting

    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    calls = []
    real = drafting.measure_target
    monkeypatch.setattr(drafting, "measure_target", lambda target, max_k: calls.append(max_k) or real(target, max_k=max_k))
    first = drafting.target_costs(tiny_target, 5)  # unkeyed: measured
    assert len(first) == 5 and calls == [5]
    tiny_target.cost_key = "test|tiny"
    try:
        keyed = drafting.target_costs(tiny_target, 5)
        assert drafting.target_costs(tiny_target, 5) == keyed and calls == [5, 5]  # read back
        for entry in (tmp_path / "target-costs").iterdir():
            entry.write_text("[not json")
        assert len(drafting.target_costs(tiny_target, 5)) == 5 and calls == [5, 5, 5]
    finally:
        del tiny_target.cost_key
