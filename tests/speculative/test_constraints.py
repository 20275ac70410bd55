"""Exactness of grammar-constrained speculative decoding on tiny models (constraints.py): chi-square of
multi-token continuations against the enumerated masked law, for a draft model, prompt lookup and
forced-token drafts at T=1 with top-p; a planted bug the same test rejects; greedy constrained
speculative == constrained plain; the matcher follows exactly the emitted tokens; penalties."""

from __future__ import annotations

import itertools

import pytest
import torch

from exactspec.speculative.grammar import Matcher, grammar_from_spec
from exactspec.speculative.law import Penalties, TargetLaw
from exactspec.speculative.loop import decode
from exactspec.speculative.loop import decode_batch
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.errors import ExactSpecError
from exactspec.speculative.sampling import SamplingParams, warp

from ..conftest import TINY_VOCAB
from ..helpers.laws import batched, batched_counts, chi_square_p, own_draft

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 3, 5]
LENGTH = 3
SAMPLES = 1500
# ids 2..7 are the bytes a..f; 0 and 1 are specials (1 is the grammar's EOS)
REGEX = "[abde]c[abef]+"  # excludes c and the specials at position 0, forces c at 1, excludes c, d at 2


@pytest.fixture(scope="module")
def fast(tiny_target):
    """The tiny target through the lean forward, whose cache holds the Monte-Carlo tests' many rows."""
    return batched(tiny_target)


@pytest.fixture(scope="module")
def llg_tok():
    from llguidance import LLTokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<s>": 0, "</s>": 1, **{ch: 2 + i for i, ch in enumerate("abcdef")}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return LLTokenizer(tok.to_str(), n_vocab=TINY_VOCAB, eos_token=1)


def matcher(llg_tok, regex=REGEX) -> Matcher:
    return Matcher(llg_tok, grammar_from_spec({"type": "regex", "regex": regex}), TINY_VOCAB)


def masked_law(target, llg_tok, params: SamplingParams) -> torch.Tensor:
    """[V**LENGTH] law of every continuation: masks from a fresh matcher fed each prefix, then the warp."""
    seqs = torch.tensor(list(itertools.product(range(TINY_VOCAB), repeat=LENGTH)))  # [N, L]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target.module(input_ids=ids).logits[:, len(PROMPT) - 1: -1]  # [N, L, V]
    law = torch.zeros(len(seqs), dtype=torch.float64)
    for n, seq in enumerate(seqs.tolist()):
        m, p = matcher(llg_tok), 1.0
        for i, tok in enumerate(seq):
            probs = warp(logits[n, i].masked_fill(~m.mask(), float("-inf")), params)
            p *= float(probs[tok])
            if p == 0:
                break
            m.commit([tok])
        law[n] = p
    return law


def counts_of(target, llg_tok, make_drafter, params, gamma, law_class=TargetLaw) -> torch.Tensor | None:
    """Counts of every continuation over SAMPLES runs, drawn as the rows of batches, each row with its own
    matcher (test_exactness.batched_counts); None if a run emitted a token the grammar forbids (the matcher
    refuses to commit it)."""
    try:
        return batched_counts(target, make_drafter, params, gamma, samples=SAMPLES, seed=99,
                              make_law=lambda: law_class(params, PROMPT, TINY_VOCAB, matcher(llg_tok)))
    except ExactSpecError:
        return None


def follows(counts: torch.Tensor | None, law: torch.Tensor) -> bool:
    if counts is None or counts[law == 0].sum() > 0:  # emitted something the grammar forbids
        return False
    return chi_square_p(counts, law) > 1e-3


class MaskFromAcceptedPrefixOnly(TargetLaw):
    """A planted bug (the matcher/speculation desync): every position of the window is masked with
    the grammar state of the accepted prefix, ignoring the drafts before it."""

    def probs(self, logits, drafts, offset=0, record=True):
        rows = [super(MaskFromAcceptedPrefixOnly, self).probs(logits[j:j + 1], [], 0, record) for j in range(len(logits))]
        return torch.cat(rows)


class DraftLawUnmaskedReported(TargetLaw):
    """A planted bug: the draft model samples from its masked law, but the verifier is handed its
    unmasked law as q (the law it did NOT sample from)."""

    def draft_probs(self, logits, prefix):
        sampled = super().draft_probs(logits, prefix)
        self.reported.append(warp(logits, self.params))
        return sampled

    def forced(self, room):
        self.reported = []
        return super().forced(room)

    def prepend_forced(self, forced, rest):
        if rest is not None and rest.probs is not None and len(self.reported) == len(rest):
            rest.probs = torch.stack(self.reported)
        return super().prepend_forced(forced, rest)


TOP_P = SamplingParams(temperature=1.0, top_p=0.9)


@pytest.mark.parametrize("drafter,gamma", [("model", 2), ("prompt-lookup", 2), ("forced", 2)])
def test_constrained_samples_follow_masked_law(tiny_target, tiny_draft, fast, llg_tok, drafter, gamma):
    make = {"model": own_draft(tiny_draft), "prompt-lookup": PromptLookupDrafter,
            "forced": lambda: None}[drafter]
    law = masked_law(tiny_target, llg_tok, TOP_P)
    counts = counts_of(fast, llg_tok, make, TOP_P, gamma)
    assert follows(counts, law), f"chi-square p={chi_square_p(counts, law):.2e}"


def test_negative_control_unsampled_draft_law_is_detected(tiny_target, tiny_draft, fast, llg_tok):
    law = masked_law(tiny_target, llg_tok, TOP_P)
    counts = counts_of(fast, llg_tok, own_draft(tiny_draft), TOP_P, 2, DraftLawUnmaskedReported)
    assert counts is not None
    assert chi_square_p(counts, law) < 1e-6


def test_negative_control_mask_without_drafts_is_detected(tiny_target, tiny_draft, fast, llg_tok):
    law = masked_law(tiny_target, llg_tok, TOP_P)
    counts = counts_of(fast, llg_tok, own_draft(tiny_draft), TOP_P, 2, MaskFromAcceptedPrefixOnly)
    assert not follows(counts, law)


class MasksEverywhere(TargetLaw):
    """The reference for greedy: every position's law from its full mask (no raw-argmax shortcut)."""

    greedy_fast = False


@pytest.mark.parametrize("regex", [REGEX, "(ab|cd)*ef", "a[b-f]{2,4}c?"])
def test_greedy_constrained_speculative_equals_plain(tiny_target, tiny_draft, llg_tok, regex):
    """Greedy under a grammar: plain and speculative (forced, draft model, prompt lookup) through the
    masked-argmax shortcut == plain with a full mask at every position."""
    greedy = SamplingParams(temperature=0)
    reference = list(decode(tiny_target, None, PROMPT, greedy, 0, 12,
                            law=MasksEverywhere(greedy, PROMPT, TINY_VOCAB, matcher(llg_tok, regex))))
    runs = []
    for make, gamma in [(lambda: None, 0), (lambda: None, 3), (lambda: ModelDrafter(tiny_draft), 3),
                        (PromptLookupDrafter, 4)]:
        law = TargetLaw(greedy, PROMPT, TINY_VOCAB, matcher(llg_tok, regex))
        runs.append(list(decode(tiny_target, make(), PROMPT, greedy, gamma, 12, law=law)))
    assert all(r == reference for r in runs), (reference, runs)
    free = list(decode(tiny_target, None, PROMPT, greedy, 0, 12))
    assert free != reference  # the grammar changed the greedy path (its raw argmax was refused somewhere)


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup"])
def test_forced_tokens_are_proposed_whatever_gamma(tiny_target, llg_tok, drafter):
    """A forced run longer than γ is proposed whole (forced tokens are outside the drafter's budget),
    also when auto γ would not speculate at all; greedy output == constrained plain."""
    from exactspec.autogamma.policy import AutoGamma
    from exactspec.autogamma.costs import CostModel
    from exactspec.stats import Stats

    greedy, regex = SamplingParams(temperature=0), "[ab]cdefcdef[ab]+"
    plain = list(decode(tiny_target, None, PROMPT, greedy, 0, 12,
                        law=TargetLaw(greedy, PROMPT, TINY_VOCAB, matcher(llg_tok, regex))))
    never = AutoGamma(CostModel([1.0, 100.0, 200.0], frozen=True))  # verifying 2+ tokens: never worth it
    for gamma in (1, never):
        stats = Stats()
        make = PromptLookupDrafter if drafter == "prompt-lookup" else lambda: None
        out = list(decode(tiny_target, make(), PROMPT, greedy, gamma, 12, stats=stats,
                          law=TargetLaw(greedy, PROMPT, TINY_VOCAB, matcher(llg_tok, regex))))
        assert out == plain
        assert stats.forced >= 7 and stats.forced_accepted == stats.forced and stats.target_calls <= 5  # γ = 1: 9+


class CheckedLaw(TargetLaw):
    """After every commit, the matcher must be in the state of a fresh matcher fed the emitted tokens."""

    llg_tok, regex = None, REGEX

    def commit(self, emitted, accepted):
        super().commit(emitted, accepted)
        self.history = getattr(self, "history", []) + emitted
        fresh = matcher(self.llg_tok, self.regex)
        fresh.commit(self.history)
        assert not self.matcher.m.is_error()
        assert self.matcher.m.compute_bitmask() == fresh.m.compute_bitmask()
        assert self.matcher.forced() == fresh.forced()
        assert self.matcher.m.is_accepting() == fresh.m.is_accepting()


def test_matcher_follows_emitted_tokens(tiny_target, tiny_draft, llg_tok):
    """EOS inside the window, max_new_tokens mid-window, invalid prompt-lookup drafts: never poisoned."""
    from exactspec.models.torch_hf import HFCausalLM

    from ..conftest import tiny_llama

    with_eos = HFCausalLM(tiny_llama(0), eos_token_ids={1})
    CheckedLaw.llg_tok, CheckedLaw.regex = llg_tok, "[abde]c[abef]{0,3}"
    gen = torch.Generator().manual_seed(5)
    ends = set()
    for trial in range(40):
        for target, make, max_new in [(with_eos, PromptLookupDrafter, 7), (with_eos, lambda: ModelDrafter(tiny_draft), 5),
                                      (tiny_target, PromptLookupDrafter, 3)]:
            law = CheckedLaw(SamplingParams(temperature=1.0), PROMPT, TINY_VOCAB,
                             matcher(llg_tok, CheckedLaw.regex))
            out = list(decode(target, make(), PROMPT, law.params, 4, max_new, gen, law=law))
            assert law.history == out
            ends.add("eos" if out[-1] == 1 else "length")
    assert ends == {"eos", "length"}


def test_batch_rows_each_keep_their_grammar(tiny_target, llg_tok):
    """decode_batch (fast_llama's batched cache) with one matcher per row == each row alone, greedy."""
    from exactspec.models.fast_llama import FastLlamaLM

    target = FastLlamaLM(tiny_target.module, set())
    greedy = SamplingParams(temperature=0)
    regexes = [REGEX, "(ab|cd)*ef", "[a-f]*"]
    alone = [list(decode(target, PromptLookupDrafter(), PROMPT, greedy, 3, 10,
                         law=TargetLaw(greedy, PROMPT, TINY_VOCAB, matcher(llg_tok, r)))) for r in regexes]
    laws = [TargetLaw(greedy, PROMPT, TINY_VOCAB, matcher(llg_tok, r)) for r in regexes]
    out = {i: [] for i in range(3)}
    for row, tokens in decode_batch(target, [PromptLookupDrafter() for _ in regexes], [PROMPT] * 3, greedy, 3, 10,
                                    [None] * 3, laws=laws):
        out[row] += tokens
    assert [out[i] for i in range(3)] == alone


def test_penalties_follow_prefix_including_drafts(tiny_target, tiny_draft):
    """Greedy with penalties: speculative (model drafts) == plain, token for token."""
    greedy = SamplingParams(temperature=0)
    pen = Penalties(logit_bias={4: 3.0}, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3)
    runs = [list(decode(tiny_target, make(), PROMPT, greedy, gamma, 16,
                        law=TargetLaw(greedy, PROMPT, TINY_VOCAB, None, pen)))
            for make, gamma in [(lambda: None, 0), (lambda: ModelDrafter(tiny_draft), 3), (PromptLookupDrafter, 4)]]
    plain = list(decode(tiny_target, None, PROMPT, greedy, 0, 16))
    assert runs[0] == runs[1] == runs[2] and runs[0] != plain


@pytest.mark.parametrize("spec", [
    {"type": "regex", "regex": "(ab"},
    {"type": "grammar", "grammar": "start: x y"},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},  # no name
    {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                            "schema": {"type": "object", "if": {"type": "object"}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
    {"type": "xml"},
])
def test_bad_constraints_are_refused(spec):
    with pytest.raises(ExactSpecError):
        grammar_from_spec(spec)


def schema_spec(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("schema,words", [
    ({"not": {}}, "matches no text"), ({"not": True}, "matches no text"),
    ({"type": "object", "not": {"description": "anything"}}, "matches no text"),  # annotations constrain nothing
    ({"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]}, "unsatisfiable"),
    ({"$defs": {"n": {"not": {}}}, "$ref": "#/$defs/n"}, "schema is false"),
])
def test_a_schema_whose_not_excludes_every_value_is_refused(schema, words):
    """llguidance ignores "not" (lenient) or refuses it (strict): one that excludes every value would
    otherwise compile to any JSON."""
    for strict in (False, True):
        with pytest.raises(ExactSpecError, match=words):
            grammar_from_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}})


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"not": {}}, "b": {"type": "integer"}}},  # a may not appear
    {"anyOf": [{"not": {}}, {"type": "string"}]}, {"type": "array", "items": {"not": {}}},
    {"properties": {"not": {}}},  # a property named "not", any value
])
def test_a_not_everything_inside_a_satisfiable_schema_compiles(schema):
    assert grammar_from_spec(schema_spec(schema))


def test_cli_refuses_a_schema_that_matches_nothing_in_one_line(tmp_path):
    from ..helpers.cli import assert_one_line_error, exactspec

    (tmp_path / "nothing.json").write_text('{"not": {}}')
    assert_one_line_error(exactspec("generate", "hi", "--json-schema", str(tmp_path / "nothing.json")),
                          "matches no text")
