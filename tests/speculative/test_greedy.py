"""Greedy identity: speculative greedy == plain greedy, token for token."""

from __future__ import annotations

import pytest
import torch

from exactspec.speculative.loop import decode
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats

from ..conftest import TINY_VOCAB
from ..helpers.prompts import REAL_PROMPTS

GREEDY = SamplingParams(temperature=0)


def run(target, drafter, prompt, gamma, n=24, stats=None):
    return list(decode(target, drafter, prompt, GREEDY, gamma, n, torch.Generator().manual_seed(0), stats))


@pytest.mark.parametrize("gamma", range(1, 7))
@pytest.mark.parametrize("kind", ["model", "prompt-lookup", "bigram"])
def test_tiny_models(tiny_target, tiny_draft, gamma, kind):
    prompt = [3, 5, 2, 3, 5, 7, 2]
    drafter = {"model": lambda: ModelDrafter(tiny_draft), "prompt-lookup": PromptLookupDrafter,
               "bigram": lambda: NGramDrafter(TINY_VOCAB, 2)}[kind]()
    stats = Stats()
    assert run(tiny_target, drafter, prompt, gamma, stats=stats) == run(tiny_target, None, prompt, 0)
    assert stats.emitted == 24 and stats.proposed > 0


@pytest.mark.parametrize("prompt", REAL_PROMPTS)
def test_embedded_model_prompt_lookup(embedded, prompt):
    plain = embedded.generate(prompt, max_new_tokens=40, temperature=0, gamma=0)
    for gamma in (1, 3, 6):
        spec = embedded.generate(prompt, max_new_tokens=40, temperature=0, gamma=gamma)
        assert spec.token_ids == plain.token_ids, f"gamma={gamma}"


def test_embedded_model_gamma_1_to_6_bigram(embedded):
    prompt = REAL_PROMPTS[1]
    plain = embedded.generate(prompt, max_new_tokens=24, temperature=0, gamma=0)
    for gamma in range(1, 7):
        spec = embedded.generate(prompt, max_new_tokens=24, temperature=0, gamma=gamma, draft="bigram")
        assert spec.token_ids == plain.token_ids, f"gamma={gamma}"
        assert spec.stats.proposed > 0
