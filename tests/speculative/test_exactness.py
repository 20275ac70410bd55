"""Monte-Carlo exactness of the whole loop on tiny random models: speculative samples of multi-token
continuations follow the exact (warped) target law; a planted always-accept bug is caught. The samples
are drawn as the rows of batches (`batched_samples`), each row an independent generation."""

from __future__ import annotations


import pytest

from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.speculative.sampling import SamplingParams

from ..conftest import TINY_VOCAB
from ..helpers.laws import CONTROL_SAMPLES, always_accept, batched, batched_counts, chi_square_p, exact_law, own_draft

pytestmark = pytest.mark.usefixtures("one_thread")

# Negative controls only have to show that the check rejects a wrong law at p < 1e-6, and 1000 samples
# do that with room to spare. With the pooling of `chi_square_p`, 200 multinomial draws of 1000 from the
# exact law of always-accept (TV 0.75 from the target's, chi-square divergence 9.6) and of the draft model
# (TV 0.53, divergence 4.9) gave p < 1e-49 every time (at 600: up to 1e-4); the loop itself, as batched
# rows seeded from 1234, 10000, 20000: p < 1e-77 and < 1e-54. The exactness tests keep SAMPLES: at 2000, an 85:15 mixture of the
# target's law and always-accept's (TV 0.11) is caught at p < 1e-3 in 87% of draws (100% at 3000).


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
