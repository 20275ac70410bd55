"""Recent prompts' indexes (drafters/prompt_indexes.py): a copy holds what an index built from scratch
holds and shares nothing with its original; a prompt that begins with a kept one indexes only the rest
(an agent's next step, a repeated prompt) and drafts what a drafter without them drafts."""

from __future__ import annotations

import random

from exactspec.drafters.prompt_indexes import PromptIndexes
from exactspec.drafters.suffix import PromptLookupDrafter, SuffixDrafter
from exactspec.drafters.suffix_index import BYTES_PER_TOKEN, SuffixIndex
from exactspec.speculative.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def state(index: SuffixIndex) -> tuple:
    """Everything a lookup reads: the hash tables, and each document's tokens and chain links."""
    return (index.heads, index.tokens, {doc: (d.tokens, [list(p) for p in d.prev]) for doc, d in index.docs.items()})


def built(tokens: list[int]) -> SuffixIndex:
    index = SuffixIndex()
    index.extend(index.new_doc(), tokens)
    return index


def text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(12) for _ in range(n)]


def test_a_copy_holds_what_a_fresh_index_holds_and_shares_nothing():
    rng = random.Random(1)
    for _ in range(50):
        first, more = text(rng, rng.randrange(0, 60)), text(rng, rng.randrange(1, 20))
        original = built(first)
        twin = original.copy()
        assert state(twin) == state(original)
        twin.extend(0, more)
        assert state(twin) == state(built(first + more))
        assert state(original) == state(built(first))  # the copy's writes did not reach it


def answer(drafter: SuffixDrafter, prompt: list[int], reply: list[int]) -> list[list[int]]:
    """A generation as the loop drives it: the prompt read, a proposal of up to 8 tokens before each
    token of `reply`, then finished. -> the proposals."""
    drafter.read_prompt(prompt)
    context, proposals = list(prompt), []
    for token in reply:
        proposals.append(drafter.propose(context, 8, GREEDY, None).tokens())
        context.append(token)
    drafter.finish(context)
    return proposals


def test_an_agents_next_step_indexes_only_its_new_tokens_and_drafts_the_same():
    """Step 2's prompt is step 1's, its answer and a tool's result: its drafter starts from step 1's
    prompt's index, indexes only the tokens after it, and proposes what a drafter that indexed
    everything proposes; rewrites begin at its own prompt's length."""
    rng = random.Random(2)
    prompts = PromptIndexes()
    system = text(rng, 40)
    step1, reply1 = system + text(rng, 10), system[5:25] + text(rng, 5)
    step2 = step1 + reply1 + text(rng, 15)
    reply2 = step2[30:50] + text(rng, 6)
    alone = [answer(PromptLookupDrafter(), p, r) for p, r in ((step1, reply1), (step2, reply2))]
    first = answer(PromptLookupDrafter(prompts=prompts), step1, reply1)
    assert prompts.reused == 0
    drafter = PromptLookupDrafter(prompts=prompts)
    drafter.read_prompt(step2)
    assert prompts.reused == len(step1)  # step 1's prompt, copied
    assert state(drafter.index) == state(built(step2)) and drafter.rewrites.prompt_len == len(step2)
    second = answer(PromptLookupDrafter(prompts=prompts), step2, reply2)
    assert [first, second] == alone and any(alone[1])


def test_a_repeated_prompt_is_copied_and_kept_once():
    rng = random.Random(3)
    prompts, prompt, reply = PromptIndexes(), text(rng, 30), text(rng, 8)
    runs = [answer(SuffixDrafter(prompts=prompts), prompt, reply) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert prompts.reused == 2 * len(prompt)
    assert [len(i.docs[d].tokens) for i, d in prompts._kept] == [len(prompt)]


def test_kept_indexes_keep_to_their_count_and_budget_and_never_mix_orders():
    rng = random.Random(4)
    prompts = PromptIndexes(budget_mb=100 * BYTES_PER_TOKEN / 2**20, kept=3)  # 100 tokens
    for n in (30, 30, 30, 30):
        prompts.keep(built(text(rng, n)), 0)
    assert len(prompts._kept) == 3
    prompts.keep(built(text(rng, 60)), 0)
    assert sum(len(i.docs[d].tokens) for i, d in prompts._kept) <= 100 and len(prompts._kept) == 2
    prompts.keep(built(text(rng, 101)), 0)  # over the budget alone: not kept
    assert len(prompts._kept) == 2
    kept = prompts._kept[-1][0].docs[0].tokens
    index, doc = prompts.start(kept + [1, 2], 64, (2, 1))  # another drafter's orders: not this one's tables
    assert not index.docs[doc].tokens and prompts.reused == 0
