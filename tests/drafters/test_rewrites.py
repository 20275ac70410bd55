"""Rewrites: a copy from the prompt runs on through what the answer has rewritten of it (a reformatting
answer), a rewrite proposed and rejected stops being written, and nothing carries over to another
generation. Token ids stand for text: 10, 11 = `",` and ` "`; 99 = `",\\n  "`, the answer's one token
in their place."""

from __future__ import annotations

from exactspec.drafters.rewrites import MAX_GAP, Rewrites, Rule
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.speculative.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
KEYS = [(20, 7), (21, 8), (22, 9), (23, 12), (24, 13), (25, 14)]  # key, value tokens
PROMPT = [1, 2, 5] + [t for i, (k, v) in enumerate(KEYS) for t in ([10, 11] if i else []) + [k, 6, v]] + [3]
ANSWER = [5] + [t for i, (k, v) in enumerate(KEYS) for t in ([99] if i else []) + [k, 6, v]] + [3]


def write(drafter, prompt: list[int], answer: list[int], k: int = 8) -> list[tuple[list[int], int]]:
    """The answer written as the decode loop would at greedy: each call proposes, the longest agreeing
    prefix is kept and the target's own next token appended. -> (proposal, kept) per call."""
    context, calls = list(prompt), []
    while len(context) < len(prompt) + len(answer):
        proposal = drafter.propose(context, k, GREEDY, None).tokens()
        truth = answer[len(context) - len(prompt):]
        kept = next((i for i, (p, t) in enumerate(zip(proposal, truth)) if p != t), min(len(proposal), len(truth)))
        context += truth[:kept + 1]
        calls.append((proposal, kept))
    return calls


def test_a_copy_runs_through_a_rewrite_the_answer_has_made_before():
    calls = write(PromptLookupDrafter(), PROMPT, ANSWER)
    # learned after two values (7, 8), written after any: two lines ahead, the rewrites in place, all kept
    assert ([23, 6, 12, 99, 24, 6, 13, 99], 8) in calls, calls
    assert len(calls) <= 8, calls  # 22 tokens; a lookup without rewrites needs 12 calls (below)
    plain = PromptLookupDrafter()
    plain.rewrites = None
    assert len(write(plain, PROMPT, ANSWER)) >= 12


def test_a_rewrite_that_is_proposed_and_rejected_stops_being_written():
    # the answer rewrites `", "` between the first keys, then keeps it as it is (an inline array)
    answer = [5, 20, 6, 7, 99, 21, 6, 8, 99, 22, 6, 9, 10, 11, 23, 6, 12, 10, 11, 24, 6, 13, 10, 11, 25, 6, 14, 3]
    drafter = PromptLookupDrafter()
    calls = write(drafter, PROMPT, answer)
    (rule,), = drafter.rewrites.rules.values()
    assert rule.src == (10, 11) and rule.out == (99,), rule
    assert ([24, 6, 13, 99, 25, 6, 14, 3], 3) in calls, calls  # written after 13 (it was kept after 7 and 8) ...
    assert rule.by_left[13] < 0 and not rule.trusted(13), rule  # ... and not kept: not written after 13 again
    assert rule.trusted(7) and rule.trusted(8)


def test_rules_belong_to_one_generation():
    drafter = PromptLookupDrafter()
    write(drafter, PROMPT, ANSWER)
    assert drafter.rewrites.rules
    drafter.propose([4, 4] + PROMPT, 8, GREEDY, None)  # another request's prompt: a new generation
    assert not drafter.rewrites.rules and drafter.rewrites.prompt_len == len(PROMPT) + 2


def test_a_rewrite_is_learned_only_within_the_gap_it_may_span():
    rewrites = Rewrites()
    prompt = [1, 2, 3, 4] + list(range(30, 30 + MAX_GAP + 1)) + [5, 6, 7]
    rewrites.start(len(prompt))
    context = prompt + [1, 2, 3, 4]
    rewrites.anchor(context, 4, 4)
    rewrites.track(context + [99, 5, 6, 7])  # the answer skips MAX_GAP + 1 prompt tokens: no rule
    assert not rewrites.rules
    rewrites = Rewrites()
    rewrites.start(len(prompt))
    rewrites.anchor(context, 4, 4)
    rewrites.track(context + [99, 38, 5, 6])  # MAX_GAP prompt tokens became one: a rule, and aligned on
    assert [(r.src, r.out) for rs in rewrites.rules.values() for r in rs] == [(tuple(range(30, 30 + MAX_GAP)), (99,))]
    assert rewrites.at_tail(context + [99, 38, 5, 6]) == len(prompt) - 1


# The prompt's one-line JSON as the embedded model meets it: each value is `":` ` "` value (6, 11, v) and
# each key follows `",` ` "` (10, 11), or `,` ` "` (15, 11) after a bare value. A pretty-printing answer
# writes `\n ` (98) before the ` "` of a key: the rule ` "` -> `\n ` ` "` after `",` and `,`, never after `":`.
def json_line(separators: list[int], broken: list[bool]) -> tuple[list[int], list[int]]:
    """-> (prompt, answer): line i+1 follows separator i, broken (98 inserted) or kept inline."""
    prompt, answer = [1, 2, 5], [5]
    for i, (k, v) in enumerate(KEYS):
        if i:
            prompt += [separators[i - 1], 11]
            answer += [separators[i - 1]] + ([98, 11] if broken[i - 1] else [11])
        prompt += [k, 6, 11, v]
        answer += [k, 6, 11, v]
    return prompt + [3], answer + [3]


def test_a_rewrite_the_target_has_begun_is_written_on():
    prompt, answer = json_line([10] * 5, [True] * 5)
    cut = answer.index(98, answer.index(22)) + 1  # the answer's `\n ` before key 23, written by the target
    drafter = PromptLookupDrafter()
    write(drafter, prompt, answer[:cut])
    # the rest of the line break, then the copy (a lookup of `",` `\n ` would copy the line after key 22)
    assert drafter.propose(prompt + answer[:cut], 8, GREEDY, None).tokens() == answer[cut:cut + 8]


def test_a_rewrite_is_not_written_where_the_answer_copied_its_input_as_it_is():
    prompt, answer = json_line([10, 10, 15, 10, 10], [True] * 5)
    drafter = PromptLookupDrafter()
    calls = write(drafter, prompt, answer)
    # kept after `",` and `,`: without the copies of `":` ` "` counted, written after `":` too (a new token)
    assert not any(p[i:i + 2] == [6, 98] for p, _ in calls for i in range(len(p))), calls
    assert ([9, 15], 2) in calls, calls  # the new `,`, where it is not trusted yet: stopped before, the target chose
    (rule,), = drafter.rewrites.rules.values()
    assert rule.src == (11,) and rule.out == (98, 11) and rule.by_left[6] < 0 and rule.misses == 0, rule


def test_a_rewrite_not_kept_after_a_token_it_was_kept_after_is_not_guessed_there_again():
    # lines 1-3 broken, then an inline list (lines 4, 5), then broken again
    prompt, answer = json_line([10] * 5, [True, True, True, False, False])
    drafter = PromptLookupDrafter()
    calls = write(drafter, prompt, answer, k=16)
    (rule,), = drafter.rewrites.rules.values()
    assert rule.misses <= 1, (rule, calls)  # proposed at most once inside the list ...
    assert ([24, 6, 11, 13, 10], 5) in calls, calls  # ... then the copy stops before it: the target decides
    assert rule.last[10] is False and rule.doubtful(10)


def test_a_rule_written_once_stops_no_copy_after_a_new_token():
    # learned from one chance rewrite (`the` -> `a` after 50): after a new token, the copy goes on
    rule = Rule((40,), (41,))
    rule.count(50, True)
    assert not rule.doubtful(52) and not rule.trusted(52)
    rule.count(50, True, proposed=False)  # written again, unprompted: a habit, and 52 is new to it
    assert rule.doubtful(52) and not rule.trusted(52)
    rule.count(52, False, proposed=False)
    assert not rule.doubtful(52) and not rule.doubtful(50)  # as their counts say
