"""A request's own view of the acceptance the engine learned (autogamma/acceptance.RequestAcceptance):
history is its prior, weighing at most LOCAL_STRENGTH proposals, so a request whose copies fail stops
paying for them after a few proposals, however long the engine's history of accepted copies."""

from __future__ import annotations

import pytest

from exactspec.autogamma.acceptance import BOLD_FROM, FORGET, LOCAL_STRENGTH, Acceptance, RequestAcceptance, bucket
from exactspec.autogamma.policy import AutoGamma
from exactspec.autogamma.costs import CostModel

KIND = ("context", "greedy")


def agent_history() -> Acceptance:
    """An engine after agent steps: 60 long copies (match 40) accepted whole, 32 drafts each."""
    shared = Acceptance()
    for _ in range(60):
        shared.of(KIND).observe(32, 32, match=40)
    return shared


def test_a_fresh_engine_and_a_request_see_the_same_prior():
    shared = Acceptance()
    view = RequestAcceptance(shared)
    for match in (None, 1, 4, 40):
        assert view.of(KIND).alpha(match) == pytest.approx(shared.of(KIND).alpha(match))
        assert view.alpha(match) == pytest.approx(shared.alpha(match))


def test_a_request_whose_copies_fail_stops_paying_for_them_long_before_the_engine_would():
    """T(k) as on a 2-core CPU (each token ~half a step more); after the agent history a 40-token match is
    drafted wide. A request's rejections move its own view as on a fresh engine (its history weighs
    LOCAL_STRENGTH proposals), the engine's by ~1/33: after three failed proposals the request decodes
    plainly, while the engine's own pricing would still draft."""
    cost = CostModel(target_s=[0.01 * (1 + 0.5 * k) for k in range(33)], frozen=True, copies=True)
    shared = agent_history()
    engine_only, own = AutoGamma(cost, acceptance=shared), AutoGamma(cost, acceptance=RequestAcceptance(shared))
    assert own.choose([(40, 32, KIND)]) > 4 and engine_only.choose([(40, 32, KIND)]) > 4
    before = shared.of(KIND).alpha(40)
    for _ in range(3):
        own.observe(32, 0, match=40, kind=KIND)  # the edit rewrites: the first copied token is rejected
    assert own.best([(40, 32, KIND)])[1] < own.min_gain  # no width pays for this request any more
    assert engine_only.best([(40, 32, KIND)])[1] > own.min_gain  # the engine's α (also moved) still would
    assert shared.of(KIND).alpha(40) < before  # the engine learns from the request too
    later = RequestAcceptance(shared)  # the next request starts from the engine's α, not the last request's
    assert later.of(KIND).alpha(40) == pytest.approx(shared.of(KIND).alpha(40))


def test_the_view_weighs_history_as_at_most_local_strength_proposals():
    shared = agent_history()
    view = RequestAcceptance(shared).of(KIND)
    view.alpha(40)
    b = 7  # the 33+ bucket
    assert view.successes[b] + view.failures[b] == pytest.approx(LOCAL_STRENGTH)
    assert shared.of(KIND).successes[b] + shared.of(KIND).failures[b] > 1 / (1 - FORGET) - 2  # ~33


def chat_history() -> Acceptance:
    """An engine after agent steps and chat: copies of every length mostly kept."""
    shared = Acceptance()
    for _ in range(20):
        for match, kept in ((3, 2), (6, 5), (12, 9)):
            shared.of(KIND).observe(12, kept, match=match)
    return shared


def test_a_request_whose_short_copies_fail_prices_its_first_long_match_lower():
    """Each bucket learns from its own proposals, and a request makes few in each: a paraphrase whose
    short copies fail (match 3-4) met its first 12-token match at the α the history taught. The tilt
    carries the request's evidence across buckets: that match is priced lower and drafted narrower; a
    request whose copies are kept is tilted up, not down."""
    cost = CostModel(target_s=[0.01 * (1 + 0.5 * k) for k in range(33)], frozen=True, copies=True)
    shared = chat_history()
    paraphrase = AutoGamma(cost, acceptance=RequestAcceptance(shared))
    before, (wide, gain) = paraphrase.acceptance.of(KIND).alpha(12), paraphrase.best([(12, 32, KIND)])
    for _ in range(4):
        paraphrase.observe(6, 0, match=3, kind=KIND)  # its short copies: the first token rejected
    view = paraphrase.acceptance.of(KIND)
    assert view.tilt < 0.5
    narrow, less = paraphrase.best([(12, 32, KIND)])
    assert view.alpha(12) < before - 0.05 and narrow < wide and less < gain
    untilted = view.successes[5] / (view.successes[5] + view.failures[5])  # bucket 9-16 alone: untouched
    assert untilted == pytest.approx(before)
    edit = AutoGamma(cost, acceptance=RequestAcceptance(shared))
    for _ in range(4):
        edit.observe(6, 6, match=3, kind=KIND)  # its copies kept whole
    assert edit.acceptance.of(KIND).tilt > 1.0 and edit.acceptance.of(KIND).alpha(12) >= before


def test_a_batch_view_starts_short_matches_no_bolder_than_a_fresh_engine():
    """After agent steps whose 3-token matches were copied on whole, a lone request starts there as bold as
    the history; a batch's (cautious) view at the fresh prior, so its first 3-token match is drafted
    narrower. Long matches start from the history either way, and a history below the prior stays below."""
    cost = CostModel(target_s=[0.01 * (1 + 0.5 * k) for k in range(33)], frozen=True, copies=True)
    shared = Acceptance()
    for _ in range(20):
        shared.of(KIND).observe(8, 8, match=3)
        shared.of(KIND).observe(32, 32, match=40)
        shared.of(KIND).observe(8, 0, match=1)
    lone, batch = RequestAcceptance(shared), RequestAcceptance(shared, cautious=True)
    prior, history = Acceptance().of(KIND), shared.of(KIND)
    assert bucket(3) < BOLD_FROM <= bucket(40)
    assert lone.of(KIND).alpha(3) == pytest.approx(history.alpha(3)) and history.alpha(3) > 0.95
    assert batch.of(KIND).alpha(3) == pytest.approx(prior.alpha(3))
    assert batch.of(KIND).alpha(40) == pytest.approx(history.alpha(40)) and prior.alpha(40) < history.alpha(40)
    assert batch.of(KIND).alpha(1) == pytest.approx(history.alpha(1)) and history.alpha(1) < prior.alpha(1)
    bold, careful = (AutoGamma(cost, acceptance=v).choose([(3, 32, KIND)]) for v in (lone, batch))
    assert careful < bold, (careful, bold)
