"""Block verification (Sun et al., ICLR 2025; speculative/verify.py `verify_block_with_uniforms`), proven
with the exact-law enumerator (tests/helpers/exact_law.py), not by sampling:

* the REAL loop with `verification="block"` (a draft model, bigram; γ 1..4; warps; batched rows; a
  grammar; penalties) emits exactly the target's law. The block rule normalises p and q in float64, so it
  meets 1e-12 (float64 rounding), tighter than the token rule's 1e-7 (test_exact_law.py's docstring);
* planted bugs in a copy of the rule move the law by more than 1e-3 (an unmutated copy: < 1e-12);
* per block, its expected number of accepted drafts is >= the token rule's, computed exactly (the law
  of the accepted count, enumerated) for random (p, q) blocks: block verification's guarantee;
* point-mass drafts keep the coupled token rule (same tokens for a seed), greedy keeps the argmax rule,
  and the option is checked (params.py);
* the batched loop on a real target (the tiny Llama pair, bit-exact alone == batched): block rows beside
  token and point-mass rows are each their lone run for a seed, greedy block rows are plain decoding,
  and each row's stats count the target calls the block rule verified (what the server reports).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.errors import FieldError
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.speculative import accept as accept_module
from exactspec.speculative import sampling
from exactspec.speculative import verify as verify_module
from exactspec.speculative.accept import ARGMAX, ON_DEVICE, Sampled, acceptance
from exactspec.speculative.law import Penalties, TargetLaw
from exactspec.speculative.fixed_gamma import as_policy
from exactspec.speculative.loop import decode, decode_rows
from exactspec.speculative.rows import Row
from exactspec.speculative.sampling import SamplingParams, as_numpy, warp
from exactspec.speculative.verify import verify_block_with_uniforms, verify_with_uniforms
from exactspec.stats import Stats

from ..conftest import TINY_VOCAB, tiny_llama

from ..helpers.exact_law import TableLM, batch_run, distance, enumerate_law, product, target_law
from ..helpers.law_checks import PROMPT, TokenGrammar, check, drafter_factory, first_tokens, grammar_oracle, penalised, target_and_draft

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_TOL = 1e-12  # float64 rounding: the rule normalises p and q in float64 (the token rule meets 1e-7)
CAUGHT = 1e-3


def block(**kw) -> SamplingParams:
    return SamplingParams(verification="block", **kw)


# --- the loop's law with block verification ------------------------------------------------------------

CASES = [("model", 1, 3, 3), ("model", 2, 3, 2), ("model", 3, 2, 2), ("model", 4, 2, 2),
         ("bigram", 1, 3, 3), ("bigram", 2, 3, 2), ("bigram", 3, 2, 2), ("bigram", 4, 2, 2)]


@pytest.mark.parametrize("name,gamma,vocab,n", CASES)
def test_block_law_equals_target_law(name, gamma, vocab, n):
    target, draft = target_and_draft(vocab)
    prompt = [t % vocab for t in PROMPT]
    law, _ = enumerate_law(first_tokens(target, drafter_factory(name, vocab, draft), prompt, block(), gamma, n))
    check(law, target_law(target, prompt, n, params=SamplingParams()), BLOCK_TOL)


WARPS = [block(temperature=0.6), block(temperature=1.3, top_k=2), block(top_p=0.7),
         block(temperature=0.9, top_k=3, top_p=0.8, min_p=0.1), block(temperature=0.0)]


@pytest.mark.parametrize("params", WARPS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("name", ["model", "bigram"])
def test_block_law_under_warps(name, params):
    vocab, n, gamma = 3, 2, 3
    target, draft = target_and_draft(vocab, sharpness=1.2)
    law, _ = enumerate_law(first_tokens(target, drafter_factory(name, vocab, draft), PROMPT, params, gamma, n))
    oracle = target_law(target, PROMPT, n, params=params)
    assert len(oracle) > 1 or params.greedy
    check(law, oracle, BLOCK_TOL)


def test_block_rows_batched_with_token_rows_are_independent_draws_of_their_own_laws():
    """A block row, a token row and a point-mass row under block (the coupled rule) in one batch."""
    vocab, n = 2, 2
    target, _ = target_and_draft(vocab)
    specs = [([0, 1, 1], lambda: ModelDrafter(TableLM(1, vocab, 0.8)), block(), 3),
             ([1, 1], lambda: NGramDrafter(vocab, 2), SamplingParams(temperature=1.4), 2),
             ([1, 0, 1, 0], PromptLookupDrafter, block(temperature=0.7), 3)]

    law, _ = enumerate_law(batch_run(target, specs, n))
    oracle = product(*(target_law(target, prompt, n, params=params) for prompt, _, params, _ in specs))
    check(law, oracle, 2e-7)  # the token row's float32 tolerance


@pytest.mark.parametrize("params", [block(), block(temperature=0.7, top_k=2)], ids=["T1", "T0.7-k2"])
def test_block_law_under_a_grammar(params):
    """Masked laws, and grammar-forced tokens (point masses inside a block of model drafts)."""
    vocab, n, gamma = 3, 3, 2
    prompt = [2, 1, 2, 0, 1, 2]
    target, draft = target_and_draft(vocab)
    make_law = lambda: TargetLaw(params, prompt, vocab, matcher=TokenGrammar(vocab, prompt[-1]))
    law, _ = enumerate_law(first_tokens(target, drafter_factory("model", vocab, draft), prompt, params, gamma, n,
                                        make_law=make_law))
    check(law, target_law(target, prompt, n, law_at=grammar_oracle(vocab, prompt, params)), BLOCK_TOL)


def test_block_law_under_penalties():
    vocab, n, gamma = 3, 2, 2
    target, draft = target_and_draft(vocab)
    params, pen = block(temperature=0.9), Penalties(logit_bias={0: -2.0}, frequency_penalty=0.5, repetition_penalty=0.7)
    make_law = lambda: TargetLaw(params, PROMPT, vocab, penalties=pen)
    law, _ = enumerate_law(first_tokens(target, drafter_factory("model", vocab, draft), PROMPT, params, gamma, n,
                                        make_law=make_law))
    check(law, target_law(target, PROMPT, n, law_at=penalised(PROMPT, pen, params, vocab)), BLOCK_TOL)


# --- planted bugs -------------------------------------------------------------------------------------

def block_verifier(bug: str | None = None):
    """A copy of verify_block_with_uniforms (exact with bug=None), scanning forward over every position,
    with one bug switched on."""
    def verify_block(draft_ids, draft_probs, target_probs, uniforms):
        gamma = len(draft_ids)
        p, q, u = as_numpy(target_probs).astype(np.float64), as_numpy(draft_probs).astype(np.float64), as_numpy(uniforms)
        p, q = p / p.sum(-1, keepdims=True), q[:gamma] / q[:gamma].sum(-1, keepdims=True)
        w = [1.0]
        for i, x in enumerate(draft_ids):
            ratio = w[-1] * p[i, x] / q[i, x]
            w.append(ratio if bug == "weight not capped at 1" else min(1.0, ratio))

        def residual(i):
            if bug == "the token rule's residual (no weight)":
                return np.maximum(p[i] - q[i], 0)
            return np.maximum(w[i] * p[i] - q[i], 0)

        tau = 0
        for i in range(1, gamma + 1):  # τ = the last i whose test passes
            if i == gamma:
                h = min(w[i], 1.0)
            else:
                mass = residual(i).sum()
                with np.errstate(divide="ignore", invalid="ignore"):  # the uncapped weight's 0 / 0
                    h = mass if bug == "stop probability not renormalised (h = R)" else mass / (mass + 1 - w[i])
            if u[i - 1] < h:
                tau = i
                if bug == "the first passing test stops (not the last)":
                    break
            elif bug == "the first failing test stops (token-style)":
                break
        law = p[gamma] if tau == gamma else residual(tau)
        if not law.sum() > 0:
            law = p[tau]
        return list(draft_ids[:tau]) + [verify_module.sample_from_uniform(law, u[gamma])]
    return verify_block


MUTANTS = {
    None: False,
    "the token rule's residual (no weight)": True,
    "stop probability not renormalised (h = R)": True,
    "weight not capped at 1": True,
    "the first passing test stops (not the last)": True,
    "the first failing test stops (token-style)": True,
}


@pytest.mark.parametrize("bug", list(MUTANTS), ids=lambda b: b or "control: the rule's copy, unmutated")
def test_block_mutant_is_caught_by_the_exact_law(monkeypatch, bug):
    vocab, gamma, n = 3, 2, 2
    target, draft = target_and_draft(vocab, sharpness=1.5)
    params = block()
    run = first_tokens(target, drafter_factory("model", vocab, draft), PROMPT, params, gamma, n)
    monkeypatch.setattr(accept_module, "verify_block_with_uniforms", block_verifier(bug))
    law, _ = enumerate_law(run)
    gap = distance(law, target_law(target, PROMPT, n, params=SamplingParams()))
    print(f"{bug}: law gap {gap:.3g}")
    if MUTANTS[bug]:
        assert gap > CAUGHT, f"{bug}: NOT caught, the law moved by {gap:.2e} only"
    else:
        assert gap < BLOCK_TOL, f"the unmutated copy moved the law by {gap:.2e}"


# --- never fewer accepted drafts than the token rule, exactly ----------------------------------------

def accepted_law(rule, target: TableLM, draft: TableLM, prompt: list[int], gamma: int, params: SamplingParams):
    """The exact law of the number of drafts one iteration accepts: γ drafts sampled from the draft's laws
    (through the uniform seam), then `rule` with γ+1 uniforms."""
    def laws(lm, ids, k):
        return warp(torch.stack([lm.logits(prompt + ids[:i]) for i in range(k)]), params)

    def run():
        ids = []
        for _ in range(gamma):
            ids.append(sampling.sample(laws(draft, ids, len(ids) + 1)[-1]))
        out = rule(ids, laws(draft, ids, gamma), laws(target, ids, gamma + 1), sampling.draw_uniforms(gamma + 1, None))
        assert out[:-1] == ids[: len(out) - 1]
        return len(out) - 1

    law, _ = enumerate_law(run)
    assert abs(sum(law.values()) - 1) < 1e-12
    return law


BLOCKS = [(seed, gamma, vocab, sharp) for seed, (gamma, vocab, sharp) in
          enumerate([(1, 4, 1.0), (2, 3, 1.5), (3, 3, 1.0), (3, 2, 2.0), (4, 2, 1.0), (4, 3, 2.5), (2, 4, 3.0)])]


@pytest.mark.parametrize("seed,gamma,vocab,sharpness", BLOCKS)
def test_block_accepts_at_least_as_many_drafts_as_the_token_rule(seed, gamma, vocab, sharpness):
    target, draft = TableLM(100 + seed, vocab, sharpness), TableLM(200 + seed, vocab, 0.7 * sharpness)
    prompt = [seed % vocab, (seed + 1) % vocab]
    params = SamplingParams(temperature=0.9)
    expected = {}
    for name, rule in (("token", verify_with_uniforms), ("block", verify_block_with_uniforms)):
        law = accepted_law(rule, target, draft, prompt, gamma, params)
        expected[name] = sum(k * m for k, m in law.items())
    # 1e-7: the token rule reads the float32 laws un-normalised (test_exact_law.py's tolerance)
    assert expected["block"] >= expected["token"] - 1e-7, expected
    if gamma == 1:  # one draft: the two rules are the same rule
        assert abs(expected["block"] - expected["token"]) < 1e-7
    else:
        assert expected["block"] > expected["token"] + 1e-6, expected  # these random blocks gain strictly


# --- the batched loop on a real target -----------------------------------------------------------------

BATCH_PROMPTS = [[3, 5, 2, 3, 5, 7, 2], [1, 2], [4, 4, 4, 4, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [6]]
LENGTH = 16


@pytest.fixture(scope="module")
def tiny_pair():
    """The tiny random Llama pair on the lean batched forward (a row's logits alone == batched, bit for
    bit: test_batch.py) -> the target, and a factory of draft-model drafters (each its own KV cache)."""
    target = FastLlamaLM(tiny_llama(0), set(), capacity=48)
    draft = tiny_llama(1, sharpness=4.0, layers=1)
    return target, lambda: ModelDrafter(FastLlamaLM(draft, set(), capacity=48))


def batched(target, specs: list[tuple], seeds: list[int | None]) -> tuple[list[list[int]], list[Row]]:
    """Rows (drafter factory, params, γ) over BATCH_PROMPTS decoded as ONE batch -> each row's tokens, the rows."""
    rows = [Row(j, prompt, make(), params, as_policy(gamma), LENGTH, None if seed is None else torch.Generator().manual_seed(seed))
            for j, (prompt, (make, params, gamma), seed) in enumerate(zip(BATCH_PROMPTS, specs, seeds))]
    out = {row.key: [] for row in rows}
    for row, tokens in decode_rows(target, rows):
        out[row.key] += tokens
    return [out[row.key] for row in rows], rows


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_block_rows_of_a_batch_each_equal_their_lone_run(tiny_pair, temperature, top_k):
    """A draft-model and a bigram row under block, a token row and a point-mass row under block, in ONE
    batch: each row's tokens are its lone run's for the same seed (each row keeps its own rule; the law of
    such a batch, enumerated, is the product of the target's laws: test_block_rows_batched_with_token_rows_...).
    The block rows' stats count the target calls the block rule verified; the others count none."""
    target, model = tiny_pair
    sampled, token = block(temperature=temperature, top_k=top_k), SamplingParams(temperature=temperature, top_k=top_k)
    bigram = lambda: NGramDrafter(TINY_VOCAB)  # noqa: E731
    specs = [(model, sampled, 3), (bigram, token, 2), (PromptLookupDrafter, sampled, 4), (bigram, sampled, 3)]
    seeds = [40, 41, 42, 43]
    out, rows = batched(target, specs, seeds)
    for j, (prompt, (make, params, gamma), seed) in enumerate(zip(BATCH_PROMPTS, specs, seeds)):
        stats = Stats()
        assert out[j] == list(decode(target, make(), prompt, params, gamma, LENGTH, torch.Generator().manual_seed(seed),
                                     stats)), j
        assert rows[j].stats.block_verified == stats.block_verified
    assert [row.stats.block_verified > 0 for row in rows] == [True, False, False, True]


def test_greedy_block_rows_of_a_batch_are_plain_decoding(tiny_pair):
    """At T = 0 block rows keep the argmax rule: batched, each row's tokens are plain greedy decoding's
    (γ 0, alone), and no target call counts as block-verified."""
    target, model = tiny_pair
    greedy = block(temperature=0)
    makers = [model, lambda: NGramDrafter(TINY_VOCAB), PromptLookupDrafter, model]
    out, rows = batched(target, [(make, greedy, 3) for make in makers], [None] * len(makers))
    assert out == [list(decode(target, None, prompt, greedy, 0, LENGTH)) for prompt in BATCH_PROMPTS]
    assert sum(row.stats.accepted for row in rows) > 0 and all(row.stats.block_verified == 0 for row in rows)


# --- where the block rule applies, and the option ------------------------------------------------------

def test_point_mass_drafts_keep_the_coupled_rule_and_its_tokens():
    """Prompt lookup under verification='block': the coupled token rule, so the same tokens for a seed."""
    vocab = 3
    target, _ = target_and_draft(vocab)
    runs = {}
    for v in ("token", "block"):
        gen = torch.Generator().manual_seed(5)
        runs[v] = list(decode(target, PromptLookupDrafter(), PROMPT, SamplingParams(verification=v), 4, 24, gen))
    assert runs["token"] == runs["block"]


def test_acceptance_rules_for_block():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    rule = acceptance(block(), None, None, cpu)
    assert isinstance(rule, Sampled) and rule.block
    on_gpu = acceptance(block(), None, None, gpu)  # the block rule runs on the host, not the batched device rule
    assert isinstance(on_gpu, Sampled) and on_gpu.block
    assert acceptance(SamplingParams(), None, None, gpu) is ON_DEVICE
    assert acceptance(block(temperature=0), None, None, cpu) is ARGMAX  # greedy: both rules keep the argmax
    assert not acceptance(SamplingParams(), None, None, cpu).block


def test_verification_option_is_checked():
    with pytest.raises(ValueError, match="verification must be one of"):
        SamplingParams(verification="tree")
    with pytest.raises(FieldError, match="lenience") as refused:  # the server's 400 names the field
        SamplingParams(verification="block", lenience=0.5)
    assert refused.value.param == "verification"
    assert SamplingParams().verification == "token"


def test_block_rule_at_gamma_zero_and_shapes():
    p = torch.tensor([[0.2, 0.8]])
    assert verify_block_with_uniforms([], torch.zeros(0, 2), p, [0.5]) == [1]
    with pytest.raises(ValueError):
        verify_block_with_uniforms([0], torch.ones(1, 2) / 2, p, [0.5, 0.5])


def test_cli_takes_verification_and_refuses_block_with_lenience():
    from ..helpers.cli import assert_one_line_error, exactspec

    assert_one_line_error(exactspec("generate", "hi", "--verification", "block", "--lenience", "0.5"), "lenience")
    assert exactspec("generate", "hi", "--verification", "tree").returncode == 2
    assert "--verification {token,block}" in exactspec("generate", "--help").stdout
