"""Exact-law tests of the whole decode loop: no sampling, no noise.

The law of the next n tokens the REAL loop emits (speculative/loop.py `decode` / `decode_rows`, the real
acceptance rules and verifier, the real drafters) is computed exactly by enumerating its random numbers
(tests/helpers/exact_law.py: every uniform drawn through `sampling.draw_uniforms` becomes an interval, split
wherever the code compares it or inverts a CDF with it; one replay of the loop per path), and compared
with the target's own law enumerated independently (the product of its warped next-token laws).

The target is `exact_law.TableLM`, a deterministic table-driven CausalLM (logits a fixed pseudo-random
function of the whole prefix) behind the batched adapter interface, not a tiny Llama: the enumeration
replays the loop thousands of times per law, and the table answers in microseconds with logits that are
the same bits whatever the batch shape (so the oracle's float32 laws are the loop's to the last bit).
Vocabularies of 2-4 tokens keep the number of paths in the hundreds.

Tolerance. Point-mass drafts (prompt lookup, suffix, plain steps) match to 1e-12 (float64 rounding).
Sampled drafts (a draft model, bigram) match to 1e-7, not 1e-9, and that is the code's own float32: warp
returns float32 laws whose sums differ from 1 by a few ulps, and the verifier's identity
min(p, q) + (1 - Σ min(p, q))·norm(max(0, p - q)) = p holds only when Σp = Σq; the measured gap is
< 3e-8 per law. Every planted bug (tests/speculative/test_mutants.py) moves the law by more than 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter, SuffixDrafter
from exactspec.drafters.suffix_index import SuffixIndex
from exactspec.speculative.law import Penalties, TargetLaw
from exactspec.speculative.loop import decode_batch
from exactspec.speculative.sampling import SamplingParams, warp

from ..helpers.exact_law import (Enumerator, TableLM, Uniform, UntrackedUse, batch_run, distance, enumerate_law, enumerated,
                        product, target_law)
from ..helpers.law_checks import POINT_TOL, PROMPT, SAMPLED_TOL, TokenGrammar, check, drafter_factory, first_tokens, grammar_oracle, penalised, target_and_draft

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the enumerator itself ---------------------------------------------------------------------------

def test_enumerator_gives_the_sampler_its_own_law():
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3])
    from exactspec.speculative import sampling
    law, runs = enumerate_law(lambda: sampling.sample(probs))
    assert runs == 3 and max(abs(law.get(i, 0) - float(probs[i])) for i in range(4)) < 1e-7


def test_enumerator_refuses_untracked_uses():
    with enumerated(Enumerator()) as enum:
        (u,) = enum.fresh(1)
        with pytest.raises(UntrackedUse):
            float(u)
        with pytest.raises(UntrackedUse):
            u * -1.0
        assert isinstance(u, Uniform)


# --- every drafter, γ 1..4, and the plain loop ---------------------------------------------------------

# (drafter, γ, vocab, n): sampled drafters enumerate V**γ drafts per iteration, so larger γ get smaller V / n
CASES = [
    ("none", 0, 3, 3),
    ("model", 1, 3, 3), ("model", 2, 3, 2), ("model", 3, 2, 2), ("model", 4, 2, 2),
    ("bigram", 1, 3, 3), ("bigram", 2, 3, 2), ("bigram", 3, 2, 2), ("bigram", 4, 2, 2),
    ("prompt-lookup", 1, 3, 4), ("prompt-lookup", 2, 3, 4), ("prompt-lookup", 3, 3, 4), ("prompt-lookup", 4, 3, 4),
]


@pytest.mark.parametrize("name,gamma,vocab,n", CASES)
def test_loop_law_equals_target_law(name, gamma, vocab, n):
    target, draft = target_and_draft(vocab)
    params = SamplingParams()
    prompt = [t % vocab for t in PROMPT]
    law, _ = enumerate_law(first_tokens(target, drafter_factory(name, vocab, draft), prompt, params, gamma, n))
    check(law, target_law(target, prompt, n, params=params), SAMPLED_TOL if name in ("model", "bigram") else POINT_TOL)


WARPS = [
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=2),
    SamplingParams(top_p=0.7),
    SamplingParams(temperature=1.5, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=3, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=0.0),  # greedy: a point mass, through the argmax rule
]


@pytest.mark.parametrize("params", WARPS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("name", ["model", "bigram", "prompt-lookup"])
def test_loop_law_under_every_warp(name, params):
    vocab, n, gamma = 3, 2, 2
    target, draft = target_and_draft(vocab, sharpness=1.2)
    law, _ = enumerate_law(first_tokens(target, drafter_factory(name, vocab, draft), PROMPT, params, gamma, n))
    oracle = target_law(target, PROMPT, n, params=params)
    assert len(oracle) > 1 or params.greedy, "a warp that leaves one continuation tests nothing"
    check(law, oracle, SAMPLED_TOL if name in ("model", "bigram") else POINT_TOL)


# --- batched rows: each row's law, and their independence ---------------------------------------------

def test_batched_rows_are_independent_draws_of_their_own_laws():
    """Three rows of one batch, each with its own prompt, drafter, sampling parameters and γ: their joint
    law is the product of their target laws (rows share one forward, never their random numbers)."""
    vocab, n = 2, 2
    target, draft = target_and_draft(vocab)
    specs = [([0, 1, 1], lambda: ModelDrafter(TableLM(1, vocab, 0.8)), SamplingParams(), 2),
             ([1, 0, 1, 0], PromptLookupDrafter, SamplingParams(temperature=0.7), 3),
             ([1, 1], lambda: NGramDrafter(vocab, 2), SamplingParams(temperature=1.4), 1)]

    law, _ = enumerate_law(batch_run(target, specs, n))
    oracle = product(*(target_law(target, prompt, n, params=params) for prompt, _, params, _ in specs))
    check(law, oracle, 2 * SAMPLED_TOL)


def test_suffix_siblings_drafting_from_each_other_are_independent():
    """n = 3 samples of one prompt, each a SuffixDrafter writing to and copying from one shared store (the
    siblings draft from each other while they run): still independent draws of the target's law."""
    vocab, n, rows = 2, 3, 3
    target, _ = target_and_draft(vocab)
    params, prompt = SamplingParams(), [0, 1, 1, 0, 1]

    def run():
        store = SuffixIndex(1.0)
        out = [[] for _ in range(rows)]
        for r, tokens in decode_batch(target, [SuffixDrafter(store) for _ in range(rows)], [prompt] * rows, params, 3,
                                      n, [None] * rows):
            out[r] += tokens
        return tuple(tuple(o) for o in out)

    law, _ = enumerate_law(run)
    marginal = target_law(target, prompt, n, params=params)
    check(law, product(*[marginal] * rows), POINT_TOL)


# --- penalties, logit bias, grammars (law.py) ------------------------------------------------------------


PENALTIES = [Penalties(logit_bias={1: 1.5}), Penalties(frequency_penalty=0.8),
             Penalties(presence_penalty=1.2, repetition_penalty=1.6), Penalties(logit_bias={0: -2.0}, frequency_penalty=0.5,
                                                                            repetition_penalty=0.7)]


@pytest.mark.parametrize("pen", PENALTIES, ids=["bias", "frequency", "presence+repetition", "all"])
@pytest.mark.parametrize("name", ["model", "prompt-lookup"])
def test_loop_law_under_penalties_and_logit_bias(name, pen):
    vocab, n, gamma = 3, 2 if name == "model" else 3, 2
    target, draft = target_and_draft(vocab)
    params = SamplingParams(temperature=0.9)
    make_law = lambda: TargetLaw(params, PROMPT, vocab, penalties=pen)
    law, _ = enumerate_law(first_tokens(target, drafter_factory(name, vocab, draft), PROMPT, params, gamma, n,
                                        make_law=make_law))
    oracle = target_law(target, PROMPT, n, law_at=penalised(PROMPT, pen, params, vocab))
    check(law, oracle, SAMPLED_TOL if name == "model" else 1e-9)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=2)], ids=["T1", "T0.7-k2"])
@pytest.mark.parametrize("name,gamma", [("model", 2), ("bigram", 1), ("prompt-lookup", 3), ("none", 0)])
def test_loop_law_under_a_grammar(name, gamma, params):
    """Masked target laws, masked draft laws, and the grammar's forced tokens as point-mass drafts."""
    vocab, n = 3, 3
    prompt = [2, 1, 2, 0, 1, 2]
    target, draft = target_and_draft(vocab)
    make_law = lambda: TargetLaw(params, prompt, vocab, matcher=TokenGrammar(vocab, prompt[-1]))
    law, _ = enumerate_law(first_tokens(target, drafter_factory(name, vocab, draft), prompt, params, gamma, n,
                                        make_law=make_law))
    check(law, target_law(target, prompt, n, law_at=grammar_oracle(vocab, prompt, params)),
          SAMPLED_TOL if name in ("model", "bigram") else POINT_TOL)


# --- lenience: the loop's law is the closed form, and it is not the target's --------------------------

def lenient_first_token(p: np.ndarray, q: np.ndarray, lenience: float) -> np.ndarray:
    """Appendix A.5's law of the first emitted token: draft x ~ q kept with min(1, p(x) / (L·q(x))), else a
    draw from norm(max(0, p - L·q)). q a point mass: the same with q = one-hot."""
    p, q = p / p.sum(), q
    keep = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, lenience * q, 1.0)), 0.0)
    residual = np.maximum(p - lenience * q, 0.0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    return q * keep + (1.0 - (q * keep).sum()) * residual


@pytest.mark.parametrize("lenience", [0.8, 0.5, 0.2])
@pytest.mark.parametrize("name,gamma", [("model", 1), ("model", 3), ("prompt-lookup", 2)])
def test_lenient_law_is_the_closed_form(name, gamma, lenience):
    vocab = 3
    target, draft = target_and_draft(vocab, sharpness=1.5)
    params = SamplingParams(temperature=0.9, lenience=lenience)
    exact = SamplingParams(temperature=0.9)
    law, _ = enumerate_law(first_tokens(target, drafter_factory(name, vocab, draft), PROMPT, params, gamma, 1))
    p = warp(target.logits(PROMPT)[None], exact)[0].double().numpy()
    if name == "model":
        q = warp(draft.logits(PROMPT)[None], exact)[0].double().numpy()
    else:
        x = int(PromptLookupDrafter().propose(PROMPT, 1, exact, None).ids[0])
        q = np.eye(vocab)[x]
    closed = {(t,): float(v) for t, v in enumerate(lenient_first_token(p, q, lenience)) if v > 0}
    check(law, closed, SAMPLED_TOL)
    assert distance(law, target_law(target, PROMPT, 1, params=exact)) > 1e-3, "lenience < 1 should be lossy here"
