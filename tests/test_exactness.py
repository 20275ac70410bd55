"""Monte-Carlo exactness of the whole loop on tiny random models: speculative samples of multi-token
continuations follow the exact (warped) target law; a planted always-accept bug is caught."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from exactspec.speculative.loop import decode
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.speculative.sampling import SamplingParams, warp
from exactspec.speculative.verify import verify

from .conftest import TINY_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 3, 5]
LENGTH = 3  # tokens per continuation -> TINY_VOCAB**3 = 512 outcomes
SAMPLES = 3000
# Negative controls only have to show that the check rejects a wrong law at p < 1e-6, and 1000 samples
# do that with room to spare. With the pooling of `chi_square_p`, 200 multinomial draws of 1000 from the
# exact law of always-accept (TV 0.75 from the target's, chi-square divergence 9.6) and of the draft model
# (TV 0.53, divergence 4.9) gave p < 1e-49 every time (at 600: up to 1e-4); the loop itself, seeds 1234,
# 1, 2: p < 1e-73 and < 1e-53. The exactness tests keep SAMPLES: at 2000, an 85:15 mixture of the
# target's law and always-accept's (TV 0.11) is caught at p < 1e-3 in 87% of draws (100% at 3000).
CONTROL_SAMPLES = 1000


def exact_law(target, params: SamplingParams) -> torch.Tensor:
    """[V**LENGTH] probability of every continuation under the warped target, by enumeration."""
    seqs = torch.tensor(list(itertools.product(range(TINY_VOCAB), repeat=LENGTH)))  # [N, L]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target.module(input_ids=ids).logits  # [N, P+L, V]
    probs = warp(logits[:, len(PROMPT) - 1 : -1], params)  # [N, L, V]: law of each continuation token
    return probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1)


def sample_counts(target, make_drafter, params, gamma, verifier=verify, samples=SAMPLES) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(TINY_VOCAB**LENGTH)
    for _ in range(samples):
        out = list(decode(target, make_drafter(), PROMPT, params, gamma, LENGTH, gen, verifier=verifier))
        counts[sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(out))] += 1
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
    make = {"model": lambda: ModelDrafter(tiny_draft), "bigram": lambda: NGramDrafter(TINY_VOCAB, 2),
            "prompt-lookup": lambda: PromptLookupDrafter()}[drafter]
    law = exact_law(tiny_target, params)
    counts = sample_counts(tiny_target, make, params, gamma)
    tv = 0.5 * (counts / counts.sum() - law).abs().sum()
    p = chi_square_p(counts, law)
    assert p > 1e-3, f"chi-square p={p:.2e}, TV={tv:.3f}"


def test_negative_control_always_accept_is_detected(tiny_target, tiny_draft):
    params = SamplingParams(temperature=1.0)
    law = exact_law(tiny_target, params)
    counts = sample_counts(tiny_target, lambda: ModelDrafter(tiny_draft), params, 2, verifier=always_accept,
                           samples=CONTROL_SAMPLES)
    assert chi_square_p(counts, law) < 1e-6


def test_negative_control_draft_law_is_detected(tiny_target, tiny_draft):
    """Sampling the draft model alone (what a broken verifier degenerates to) is far from the target law."""
    params = SamplingParams(temperature=1.0)
    law = exact_law(tiny_target, params)
    counts = sample_counts(tiny_draft, lambda: None, params, 0, samples=CONTROL_SAMPLES)
    assert chi_square_p(counts, law) < 1e-6
