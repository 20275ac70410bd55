"""Lenience (paper appendix A.5), opt-in and lossy: the verifier against its reference, L = 1 is the
exact rule, L < 1 accepts more and its output follows the lenient law (not the target's), refusals of
L outside (0, 1], and the knob end to end (CLI error, server `speculative` object)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from exactspec.speculative.loop import decode
from exactspec.drafters.model import ModelDrafter
from exactspec.speculative.sampling import SamplingParams, warp
from exactspec.stats import Stats, total
from exactspec.speculative.verify import accept_greedy, accept_greedy_lenient, verify, verify_reference, verify_with_uniforms

from ..conftest import TINY_VOCAB
from ..helpers.laws import batched, batched_samples, own_draft
from ..helpers.cli import assert_one_line_error, exactspec

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 5, 2, 3, 5]


def random_case(rng: np.random.Generator, gamma: int, vocab: int = 6, point_mass: bool = False):
    p = torch.tensor(rng.dirichlet(np.ones(vocab) * 0.5, gamma + 1), dtype=torch.float32)
    q = None if point_mass else torch.tensor(rng.dirichlet(np.ones(vocab) * 0.5, gamma), dtype=torch.float32)
    ids = [int(rng.integers(vocab)) for _ in range(gamma)]
    return ids, q, p, rng.random(gamma + 1).tolist()


@pytest.mark.parametrize("lenience", [1.0, 0.7, 0.3])
@pytest.mark.parametrize("point_mass", [False, True])
def test_verifier_matches_reference(lenience, point_mass):
    rng = np.random.default_rng(7)
    for _ in range(400):
        ids, q, p, u = random_case(rng, int(rng.integers(1, 5)), point_mass=point_mass)
        got = verify_with_uniforms(ids, q, p, u, lenience)
        assert got == verify_reference(ids, q, p, u, lenience)
        if lenience == 1.0:
            assert got == verify_with_uniforms(ids, q, p, u)


def test_greedy_lenient_rule():
    rng = np.random.default_rng(3)
    for _ in range(300):
        ids, _, p, _ = random_case(rng, 4)
        assert accept_greedy_lenient(ids, p, 1.0) == accept_greedy(ids, p.argmax(-1).tolist())
        out = accept_greedy_lenient(ids, p, 0.4)
        n = len(out) - 1
        assert out[:n] == ids[:n] and all(p[i, ids[i]] >= 0.4 * p[i].max() for i in range(n))
        assert out[n] == int(p[n].argmax())
        assert n == len(ids) or p[n, ids[n]] < 0.4 * p[n].max()


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan")])
def test_lenience_outside_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match="lenience"):
        SamplingParams(lenience=bad)
    with pytest.raises(ValueError, match="lenience"):
        verify([1], None, torch.full((2, 4), 0.25), lenience=bad)


def test_cli_refuses_bad_lenience_and_labels_it_lossy():
    assert_one_line_error(exactspec("generate", "hi", "--lenience", "0"), "lenience")
    assert_one_line_error(exactspec("generate", "hi", "--lenience", "2"), "lenience")
    help_text = exactspec("generate", "--help").stdout
    assert "--lenience" in help_text and "LOSSY" in help_text


def first_tokens(target, draft, params, samples: int = 1500) -> tuple[torch.Tensor, Stats]:
    """Counts of the first generated token with γ = 1 (an accepted draft or the residual's sample), drawn
    as the rows of one batch (test_exactness.batched_samples), and the rows' stats summed."""
    stats = []
    seqs = batched_samples(batched(target), own_draft(draft), params, 1, samples, length=2, rows=samples, seed=11,
                           stop_on_eos=False, row_stats=stats)
    return torch.bincount(torch.tensor([seq[0] for seq in seqs]), minlength=TINY_VOCAB).float(), total(stats)


def next_laws(model, params) -> torch.Tensor:
    with torch.no_grad():
        return warp(model.module(input_ids=torch.tensor([PROMPT])).logits[0, -1], params).double()  # [V]


def lenient_law(p: torch.Tensor, q: torch.Tensor, lenience: float) -> torch.Tensor:
    """The law of one lenient step: accept x ~ q with prob min(1, p/(Lq)), else norm(max(0, p - Lq))."""
    accepted = torch.minimum(q, p / lenience)
    residual = (p - lenience * q).clamp_min(0)
    return accepted + (1 - accepted.sum()) * residual / residual.sum()


def p_value(counts: torch.Tensor, law: torch.Tensor) -> float:
    keep = law > 0
    return float(chisquare(counts[keep].numpy(), (law[keep] / law[keep].sum() * counts.sum()).numpy()).pvalue)


def test_lenience_raises_acceptance_and_moves_the_law(tiny_target, tiny_draft):
    """L = 1: the target's law. L = 0.3: more drafts accepted, and the first token follows the lenient
    law computed in closed form, which the same chi-square test tells apart from the target's."""
    params = SamplingParams(temperature=1.0)
    p, q = next_laws(tiny_target, params), next_laws(tiny_draft, params)
    exact_counts, exact_stats = first_tokens(tiny_target, tiny_draft, params)
    lenient = SamplingParams(temperature=1.0, lenience=0.3)
    lenient_counts, lenient_stats = first_tokens(tiny_target, tiny_draft, lenient)
    law = lenient_law(p, q, 0.3)
    assert 0.5 * (law - p).abs().sum() > 0.05, "draft too close to target: the test would prove little"
    assert p_value(exact_counts, p) > 1e-3
    assert p_value(lenient_counts, law) > 1e-3
    assert p_value(lenient_counts, p) < 1e-6, "lenience did not move the output law"
    assert lenient_stats.acceptance_rate > exact_stats.acceptance_rate + 0.05
    assert lenient_stats.lenience == 0.3 and not lenient_stats.exact and exact_stats.exact


def test_lenience_one_is_the_exact_path(tiny_target, tiny_draft):
    for temperature in (0.0, 1.0):
        runs = []
        for params in (SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, lenience=1.0)):
            gen = torch.Generator().manual_seed(5)
            runs.append(list(decode(tiny_target, ModelDrafter(tiny_draft), PROMPT, params, 3, 24, gen, stop_on_eos=False)))
        assert runs[0] == runs[1]


def test_greedy_lenience_accepts_more(tiny_target, tiny_draft):
    stats = {}
    for lenience in (1.0, 0.2):
        stats[lenience] = Stats()
        list(decode(tiny_target, ModelDrafter(tiny_draft), PROMPT, SamplingParams(temperature=0, lenience=lenience), 3,
                    60, None, stats[lenience], stop_on_eos=False))
    assert stats[0.2].acceptance_rate > stats[1.0].acceptance_rate
