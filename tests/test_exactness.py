"""Monte-Carlo exactness of the whole loop on tiny random models: speculative samples of multi-token
continuations follow the exact (warped) target law; a planted always-accept bug is caught. The samples
are drawn as the rows of batches (`batched_samples`), each row an independent generation."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from exactspec.speculative.loop import decode, decode_batch
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.models.torch_hf import HFCausalLM
from exactspec.speculative.sampling import SamplingParams, warp
from exactspec.speculative.verify import verify
from exactspec.stats import Stats

from .conftest import TINY_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 3, 5]
LENGTH = 3  # tokens per continuation -> TINY_VOCAB**3 = 512 outcomes
SAMPLES = 3000
# Negative controls only have to show that the check rejects a wrong law at p < 1e-6, and 1000 samples
# do that with room to spare. With the pooling of `chi_square_p`, 200 multinomial draws of 1000 from the
# exact law of always-accept (TV 0.75 from the target's, chi-square divergence 9.6) and of the draft model
# (TV 0.53, divergence 4.9) gave p < 1e-49 every time (at 600: up to 1e-4); the loop itself, as batched
# rows seeded from 1234, 10000, 20000: p < 1e-77 and < 1e-54. The exactness tests keep SAMPLES: at 2000, an 85:15 mixture of the
# target's law and always-accept's (TV 0.11) is caught at p < 1e-3 in 87% of draws (100% at 3000).
CONTROL_SAMPLES = 1000
ROWS = 500  # samples drawn as the rows of one batch (`batched_counts`)


def exact_law(target, params: SamplingParams) -> torch.Tensor:
    """[V**LENGTH] probability of every continuation under the warped target, by enumeration."""
    seqs = torch.tensor(list(itertools.product(range(TINY_VOCAB), repeat=LENGTH)))  # [N, L]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target.module(input_ids=ids).logits  # [N, P+L, V]
    probs = warp(logits[:, len(PROMPT) - 1 : -1], params)  # [N, L, V]: law of each continuation token
    return probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1)


def index(seq: list[int]) -> int:
    """The cell of a continuation in the [V**LENGTH] law."""
    return sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(seq))


def sample_counts(target, make_drafter, params, gamma, verifier=verify, samples=SAMPLES) -> torch.Tensor:
    """Counts of `samples` continuations, one generation after another (a one-row target), one generator."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(TINY_VOCAB**LENGTH)
    for _ in range(samples):
        counts[index(list(decode(target, make_drafter(), PROMPT, params, gamma, LENGTH, gen, verifier=verifier)))] += 1
    return counts


def batched(model: HFCausalLM) -> FastLlamaLM:
    """The same tiny model through the lean forward, whose cache holds many rows (16 positions each: a
    continuation of PROMPT takes 8)."""
    return FastLlamaLM(model.module, set(), capacity=16)


def own_draft(model: HFCausalLM):
    """A drafter factory for `batched_samples`: each row's ModelDrafter over its own adapter of `model` (a
    shared adapter's cache would be overwritten by the other rows' drafts), the lean forward (1.7x faster
    than transformers' here)."""
    return lambda: ModelDrafter(batched(model))


def batched_samples(target, make_drafter, params, gamma, samples, length=LENGTH, rows=ROWS, seed=1234,
                    verifier=verify, make_law=None, stop_on_eos=True, row_stats=None) -> list[list[int]]:
    """`samples` continuations of PROMPT (up to `length` tokens) drawn as the rows of batches of `rows`: one
    target forward per iteration serves every row, where one generation after another pays a forward (and
    a prefill) per sample. Sample i has its own drafter, generator (seeded seed + i) and law (`make_law()`),
    so the samples are independent draws of the loop. Each row's Stats is appended to `row_stats`."""
    out = []
    for start in range(0, samples, rows):
        n = min(rows, samples - start)
        gens = [torch.Generator().manual_seed(seed + start + r) for r in range(n)]
        laws = None if make_law is None else [make_law() for _ in range(n)]
        stats, seqs = [Stats() for _ in range(n)], [[] for _ in range(n)]
        for r, tokens in decode_batch(target, [make_drafter() for _ in range(n)], [PROMPT] * n, params, gamma, length,
                                      gens, stats, stop_on_eos=stop_on_eos, verifier=verifier, laws=laws):
            seqs[r] += tokens
        out += seqs
        if row_stats is not None:
            row_stats += stats
    return out


def batched_counts(target, make_drafter, params, gamma, verifier=verify, samples=SAMPLES, **kw) -> torch.Tensor:
    """Counts of every continuation over `samples` draws of `batched_samples` (same keywords)."""
    counts = torch.zeros(TINY_VOCAB**LENGTH)
    for seq in batched_samples(target, make_drafter, params, gamma, samples, verifier=verifier, **kw):
        counts[index(seq)] += 1
    return counts


def chi_square_p(counts: torch.Tensor, law: torch.Tensor) -> float:
    """p-value of counts ~ Multinomial(law), pooling cells with expected count < 5 into one."""
    expected = law * counts.sum()
    assert counts[law == 0].sum() == 0, "sampled a continuation the target gives zero probability"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:  # nothing small to pool (e.g. top-k zeroed every rare continuation)
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def always_accept(draft_ids, draft_probs, target_probs, generator=None):
    """A planted bug: accept every draft and take the bonus greedily."""
    return draft_ids + [int(target_probs[len(draft_ids)].argmax())]


@pytest.mark.parametrize("drafter,params,gamma", [
    ("model", SamplingParams(temperature=1.0), 2),
    ("model", SamplingParams(temperature=0.8, top_k=5, top_p=0.9), 3),
    ("bigram", SamplingParams(temperature=1.0, min_p=0.05), 2),
    ("prompt-lookup", SamplingParams(temperature=1.0), 2),
])
def test_speculative_samples_follow_target_law(tiny_target, tiny_draft, drafter, params, gamma):
    make = {"model": own_draft(tiny_draft), "bigram": lambda: NGramDrafter(TINY_VOCAB, 2),
            "prompt-lookup": lambda: PromptLookupDrafter()}[drafter]
    law = exact_law(tiny_target, params)
    counts = batched_counts(batched(tiny_target), make, params, gamma)
    tv = 0.5 * (counts / counts.sum() - law).abs().sum()
    p = chi_square_p(counts, law)
    assert p > 1e-3, f"chi-square p={p:.2e}, TV={tv:.3f}"


def test_negative_control_always_accept_is_detected(tiny_target, tiny_draft):
    params = SamplingParams(temperature=1.0)
    law = exact_law(tiny_target, params)
    counts = batched_counts(batched(tiny_target), own_draft(tiny_draft), params, 2, verifier=always_accept,
                            samples=CONTROL_SAMPLES)
    assert chi_square_p(counts, law) < 1e-6


def test_negative_control_draft_law_is_detected(tiny_target, tiny_draft):
    """Sampling the draft model alone (what a broken verifier degenerates to) is far from the target law."""
    params = SamplingParams(temperature=1.0)
    law = exact_law(tiny_target, params)
    counts = batched_counts(batched(tiny_draft), lambda: None, params, 0, samples=CONTROL_SAMPLES)
    assert chi_square_p(counts, law) < 1e-6
