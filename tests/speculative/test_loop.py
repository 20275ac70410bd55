"""Decode-loop edge cases and the drafters' contracts."""

from __future__ import annotations

import pytest
import torch

from exactspec.speculative.loop import decode
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.errors import ExactSpecError
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats
from ..helpers.scripted import Scripted

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0)


def plain(target, prompt, n):
    return list(decode(target, None, prompt, GREEDY, 0, n))


def test_empty_proposals_take_plain_steps(tiny_target):
    stats = Stats()
    out = list(decode(tiny_target, Scripted(lambda c: []), [1, 2, 3], GREEDY, 4, 10, stats=stats))
    assert out == plain(tiny_target, [1, 2, 3], 10)
    assert stats.proposed == 0 and stats.target_calls == 10


def test_all_accepted_when_draft_is_the_target_itself(tiny_target):
    reference = plain(tiny_target, [1, 2, 3], 20)
    oracle = Scripted(lambda c: reference[len(c) - 3 :])
    stats = Stats()
    out = list(decode(tiny_target, oracle, [1, 2, 3], GREEDY, 4, 20, stats=stats))
    assert out == reference
    assert stats.accepted == stats.proposed and stats.tokens_per_target_call == 5.0
    assert stats.accepted_per_position == [stats.target_calls] * 4


def test_first_rejected_every_time(tiny_target):
    reference = plain(tiny_target, [1, 2, 3], 12)
    wrong = Scripted(lambda c: [(reference[len(c) - 3] + 1) % 8] * 4)
    stats = Stats()
    out = list(decode(tiny_target, wrong, [1, 2, 3], GREEDY, 4, 12, stats=stats))
    assert out == reference and stats.accepted == 0 and stats.target_calls == 12


def test_eos_inside_accepted_prefix_stops_there(tiny_target):
    reference = plain(tiny_target, [1, 2, 3], 20)
    eos = reference[5]
    tiny_target.eos_token_ids = {eos}
    try:
        oracle = Scripted(lambda c: reference[len(c) - 3 :])
        out = list(decode(tiny_target, oracle, [1, 2, 3], GREEDY, 6, 20))
    finally:
        tiny_target.eos_token_ids = set()
    first = reference.index(eos)
    assert out == reference[: first + 1]


@pytest.mark.parametrize("budget", [1, 2, 5, 7])
def test_max_new_tokens_reached_mid_block(tiny_target, budget):
    reference = plain(tiny_target, [1, 2, 3], 20)
    oracle = Scripted(lambda c: reference[len(c) - 3 :])
    stats = Stats()
    out = list(decode(tiny_target, oracle, [1, 2, 3], GREEDY, 4, budget, stats=stats))
    assert out == reference[:budget] and stats.emitted == budget


def test_seeded_sampling_is_deterministic(tiny_target):
    params = SamplingParams(temperature=1.0)
    runs = [list(decode(tiny_target, PromptLookupDrafter(), [1, 2, 3, 1, 2], params, 3, 30,
                        torch.Generator().manual_seed(5))) for _ in range(2)]
    assert runs[0] == runs[1]


def test_context_limit_stops_generation(tiny_target):
    out = list(decode(tiny_target, PromptLookupDrafter(), [1, 2, 3] * 40, GREEDY, 4, 100))
    assert len(out) == tiny_target.max_length - 120


def test_prompt_longer_than_context_is_refused(tiny_target):
    with pytest.raises(ExactSpecError):
        list(decode(tiny_target, None, [1] * 500, GREEDY, 0, 4))


def test_prompt_lookup_proposes_continuation_of_latest_match():
    d = PromptLookupDrafter(max_ngram=2)
    assert d.propose([5, 6, 7, 8, 1, 5, 6, 9, 9, 5, 6], 3, GREEDY, None).tokens() == [9, 9, 5]
    assert len(d.propose([1, 2, 3, 4], 3, GREEDY, None)) == 0  # nothing matches: empty proposal


def test_bigram_counts_context_once():
    d = NGramDrafter(10, order=2)
    d.propose([1, 2, 1, 2], 1, GREEDY, None)
    d.propose([1, 2, 1, 2, 1], 1, GREEDY, None)
    assert d.bigram[1][2] == 2 and d.bigram[2][1] == 2 and d.unigram.tolist()[:3] == [0, 3, 2]
    assert d.propose([1, 2, 1, 2, 1], 2, GREEDY, None).tokens() == [2, 1]


def test_a_copy_is_cut_before_a_drafted_end_of_sequence():
    """An EOS drafted saves no pass (the pass verifying it would have given it) and nothing after it is
    used: a copy stops before it. A sampled draft is not cut (stopping where a sampled token is EOS would
    bias the tokens before it); a grammar's forced tokens are not a draft's."""
    from exactspec.speculative.interfaces import Proposal
    from exactspec.speculative.propose import before_eos

    copy = Proposal([5, 1, 3], None, 2)
    assert before_eos(copy, 0, {1}).tokens() == [5] and before_eos(copy, 0, {1}).match == 2
    assert before_eos(Proposal([1, 3], None, 2), 0, {1}) is None
    assert before_eos(copy, 0, set()) is copy and before_eos(None, 0, {1}) is None
    sampled = Proposal(torch.tensor([5, 1]), torch.full((2, 8), 1 / 8), 0)
    assert before_eos(sampled, 0, {1}) is sampled
    assert before_eos(Proposal([1, 5, 1, 6], None), 1, {1}).tokens() == [1, 5]


def test_no_draft_holds_an_eos_and_the_output_is_plain_decodings():
    """A prompt whose copies run into the end of sequence (as a chat prompt's copies run into the turn's
    end): no verified draft holds EOS, and the text is plain greedy decoding's. Control: without the cut
    (`before_eos` a no-op) the same run drafts EOS."""
    from exactspec.models.torch_hf import HFCausalLM
    from exactspec.speculative import propose as propose_module
    from exactspec.speculative.verify import verify

    from ..conftest import tiny_llama

    target = HFCausalLM(tiny_llama(0), eos_token_ids={1})
    greedy = SamplingParams(temperature=0)
    prompt = [3, 5, 1, 2, 3, 5, 1, 4, 3, 5, 1, 6, 3, 5]

    def drafted(cut=True):
        seen = []

        def recording(drafts, *args, **kwargs):
            seen.extend(drafts.tolist() if isinstance(drafts, torch.Tensor) else list(drafts))
            return verify(drafts, *args, **kwargs)

        real = propose_module.before_eos
        if not cut:
            propose_module.before_eos = lambda proposal, forced, eos: proposal
        try:
            out = list(decode(target, PromptLookupDrafter(), prompt, greedy, 4, 12, torch.Generator(), verifier=recording))
        finally:
            propose_module.before_eos = real
        return out, seen

    plain = list(decode(target, None, prompt, greedy, 0, 12))
    out, seen = drafted()
    assert out == plain and seen and 1 not in seen
    assert 1 in drafted(cut=False)[1]
