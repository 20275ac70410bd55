"""The spacing of a context-only copier's lookups under auto γ (speculative/lookups.py): only lookups that
cannot pay are skipped, and a lookup that surely finds nothing does not ask the drafter."""

from __future__ import annotations

import pytest

from exactspec.autogamma.costs import CostModel
from exactspec.autogamma.policy import AutoGamma

pytestmark = pytest.mark.usefixtures("one_thread")


def asked(drafter) -> list[int]:
    """The context lengths `drafter` is asked to propose at, from now on (auto γ does not ask it where it
    can tell that nothing is to be found: lookups.cannot_match)."""
    lengths, lookup = [], drafter.propose
    drafter.propose = lambda *args, **kwargs: lengths.append(len(args[0])) or lookup(*args, **kwargs)
    return lengths


def replay_lookups(extra_per_token: float, text: list[int], pays_from: int
                   ) -> tuple[list[bool], list[bool], list[bool]]:
    """A prompt-lookup row under auto γ (T(k) = 1 + extra_per_token·(k-1), frozen, no probes) fed `text`
    token by token -> per step: whether it looked up, whether a full lookup finds a match of `pays_from`+
    tokens (checked: the shortest auto γ prices as paying), whether the context's last token was new."""
    from exactspec.drafters.suffix import PromptLookupDrafter
    from exactspec.drafters.suffix_index import SuffixIndex
    from exactspec.speculative.propose import propose
    from exactspec.speculative.rows import Row
    from exactspec.speculative.sampling import SamplingParams

    auto = AutoGamma(CostModel([1.0 + extra_per_token * k for k in range(33)], copies=True, frozen=True),
                     first_probe=10**6)
    drafter = PromptLookupDrafter()
    row = Row(0, text[:2], drafter, SamplingParams(temperature=0), auto, 10**6, None)
    looked, paying, new = [], [], []
    for token in text[2:]:
        looked.append(len(row.context) >= row.lookup_at)  # not spaced out: it looks (or tells it cannot match)
        propose([row], 10**6)
        reference = SuffixIndex(orders=drafter.orders)
        reference.extend(reference.new_doc(), row.context)
        match = reference.find(row.context)
        paying.append(match is not None and match.length >= pays_from)
        new.append(row.context[-1] not in row.context[:-1])
        row.context.append(token)
    assert auto.shortest_paying([("context", "greedy")], drafter.max_match) == pays_from
    return looked, paying, new


def test_prompt_lookup_under_auto_skips_only_lookups_that_cannot_pay():
    """lookups.next_lookup: a context-only copier under auto γ looks up again only once a match could have
    grown to the shortest paying length (a match grows by at most a token per token the context gains).
    Replayed token by token over a text that copies an earlier passage: every step whose full lookup finds a
    paying match did look up, and the steps before the copy skipped most lookups."""
    passage = list(range(100, 140))
    text = list(range(200, 230)) + passage[:25] + list(range(300, 340)) + passage  # the passage, then its copy
    looked, paying, _ = replay_lookups(0.65, text, 5)  # matches of 5+ pay
    assert sum(paying) >= 20 and all(look for look, pays in zip(looked, paying) if pays)
    assert sum(looked) < len(looked) // 2  # before the copy: one lookup in 3 or fewer


def test_after_a_new_token_the_lookup_that_cannot_find_a_match_is_skipped():
    """lookups.next_lookup where a lookup finds nothing: the tail's match is the longest n-gram, of the
    orders not looked up, that occurred before (`Lookups.seen_tail`), 0 after a token never seen. Where
    matches of 2 pay, the lookup right after a new token is skipped (none can be found there), and a seen
    token is looked up after. Replayed over new words, then words seen before, then a copy: every step
    whose full lookup finds a paying match did look up."""
    passage = list(range(100, 120))
    seen_again = [100, 205, 110, 215, 101, 230, 111, 201]  # each seen before, no pair of them
    text = passage + list(range(200, 240)) + seen_again + passage
    looked, paying, new = replay_lookups(0.48, text, 2)  # matches of 2+ pay, of 1 not
    assert sum(paying) >= 15 and all(look for look, pays in zip(looked, paying) if pays)
    after = [(is_new, looked[i + 1]) for i, is_new in enumerate(new[:-1]) if looked[i] and not paying[i]]
    assert all(not next_looked for is_new, next_looked in after if is_new)  # after a new token: skipped
    assert all(next_looked for is_new, next_looked in after if not is_new)  # after one seen: looked up
    assert sum(is_new for is_new, _ in after) >= 20 and sum(not is_new for is_new, _ in after) >= 6


def test_a_lookup_that_cannot_match_does_not_ask_the_drafter(monkeypatch):
    """lookups.cannot_match: where the context's trailing n-gram of the shortest order looked up never
    occurred (here matches of 2+ pay), the drafter is not asked, and the row's next lookup is the one a
    lookup finding nothing sets; the first iteration's is decided so before the prefill (`prepare`).
    Replayed over new words, words seen before and a copy of the prompt, against a row that always asks:
    the same drafts and lookups, the drafter asked far less, and not at the prompt's end."""
    from exactspec.drafters.suffix import PromptLookupDrafter
    from exactspec.speculative import propose as steps
    from exactspec.speculative.rows import Row
    from exactspec.speculative.sampling import SamplingParams

    passage = list(range(100, 120))
    prompt = list(range(200, 220)) + passage + [300]  # ends with a token never seen before
    answer = list(range(400, 430)) + [100, 205, 110, 215, 101, 230, 111] + passage

    def replay(tells: bool) -> tuple[list, list[int], list[int]]:
        auto = AutoGamma(CostModel([1.0 + 0.48 * k for k in range(33)], copies=True, frozen=True), first_probe=10**6)
        drafter = PromptLookupDrafter()
        row = Row(0, prompt, drafter, SamplingParams(temperature=0), auto, 10**6, None)
        lookups, drafts, spacing = asked(drafter), [], []
        with monkeypatch.context() as m:
            if not tells:
                m.setattr(steps, "cannot_match", lambda row: False)
            steps.prepare(row)
            for token in answer:
                drafts.append(steps.propose([row], 10**6)[0].ids)
                spacing.append(row.lookup_at)
                row.context.append(token)
        assert drafter.shortest == 2
        return drafts, spacing, lookups

    told, always = replay(True), replay(False)
    assert told[:2] == always[:2] and sum(map(len, told[0])) >= 10  # the same drafts and lookups; the copy drafted
    assert always[2][0] == len(prompt) and told[2][0] > len(prompt)
    assert len(told[2]) * 2 < len(always[2])
