"""Warps: HF order and semantics, validation of bad parameters."""

import pytest
import torch

from exactspec.speculative.sampling import SamplingParams, warp


def test_greedy_is_one_hot_argmax():
    probs = warp(torch.tensor([[0.1, 2.0, -1.0]]), SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_temperature_then_top_k_then_top_p_then_min_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = warp(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (p[3:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)  # [0.636, 0.234, 0.086, ...]
    p = warp(logits, SamplingParams(top_p=0.7))  # keeps tokens until 0.7 mass is reached: 0 and 1
    assert (p[2:] == 0).all() and torch.allclose(p[:2], full[:2] / full[:2].sum())
    p = warp(logits, SamplingParams(min_p=0.2))  # keep p >= 0.2 * 0.636
    assert (p[2:] == 0).all()


def test_matches_transformers_processors():
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    hf = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)])
    expected = hf(None, logits.clone()).softmax(-1)
    ours = warp(logits, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05))
    assert torch.allclose(ours, expected, atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                    dict(min_p=2.0), dict(temperature=float("nan"))])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
