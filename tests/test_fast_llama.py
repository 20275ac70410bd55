"""The lean Llama forward computes what transformers computes, and rolls back by length."""

from __future__ import annotations

import torch

from exactspec.models.fast_llama import FastLlamaLM, supports
from exactspec.models.light_llama import hf_module
from exactspec.models.torch_hf import HFCausalLM

from .conftest import tiny_llama


def test_tiny_logits_match_transformers_through_rollbacks():
    """Prefill (no logits), then forwards and truncations: both adapters give the same logits."""
    module = tiny_llama(3, vocab=16)
    hf, fast = HFCausalLM(module, set()), FastLlamaLM(module, set(), capacity=8)  # capacity grows
    ids = torch.randint(0, 16, (1, 40), generator=torch.Generator().manual_seed(0))
    for lm in (hf, fast):
        assert lm.prefill(ids[:, :10]) is None and lm.length == 10
    for start, k, keep in [(10, 4, 12), (12, 6, 15), (15, 1, 16), (16, 9, 25)]:
        a, b = hf.forward(ids[:, start : start + k]), fast.forward(ids[:, start : start + k])
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        hf.truncate(keep)
        fast.truncate(keep)
    assert fast.length == 25


def test_embedded_model_matches_transformers(embedded):
    target = embedded.target
    assert isinstance(target, FastLlamaLM) and supports(target.module)
    hf = HFCausalLM(hf_module(target.module), target.eos_token_ids)
    ids = torch.tensor([embedded.encode("Name three colours.")])
    a, b = hf.forward(ids), target.forward(ids) if target.reset() is None else None
    assert torch.allclose(a, b, atol=1e-4)
    target.reset()


def test_embedded_greedy_equals_transformers_generate(embedded):
    ids = embedded.encode("Rewrite in the past tense: I walk to school.")
    ours = embedded.generate("Rewrite in the past tense: I walk to school.", max_new_tokens=24, temperature=0, gamma=4)
    eos = sorted(embedded.target.eos_token_ids)
    with torch.inference_mode():
        out = hf_module(embedded.target.module).generate(input_ids=torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                              eos_token_id=eos, pad_token_id=eos[0])
    assert ours.token_ids == out[0, len(ids):].tolist()
