"""The verifier alone: its law is the target law, it matches the reference loop."""

from __future__ import annotations

import pytest
import torch

from exactspec.speculative.sampling import SamplingParams, sample_from_uniform, warp
from exactspec.speculative.verify import accept_greedy, verify, verify_reference, verify_with_uniforms

WARPS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0),
]


def sampler_law(probs: torch.Tensor) -> torch.Tensor:
    """Exact law of sample_from_uniform(probs, u), u ~ U[0,1), found by bisecting its monotone steps."""
    vocab = probs.shape[-1]
    cdf = torch.zeros(vocab + 1, dtype=torch.float64)
    for j in range(vocab):  # cdf[j+1] = sup{u : sample(u) <= j}
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if sample_from_uniform(probs, mid) <= j:
                lo = mid
            else:
                hi = mid
        cdf[j + 1] = lo
    cdf[-1] = 1.0
    return cdf.diff()


def accept_probability(draft_ids, draft_probs, target_probs, position: int = 0) -> float:
    """sup{u : the verifier accepts draft `position`} — the implemented acceptance probability."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        u = torch.zeros(len(draft_ids) + 1, dtype=torch.float64)
        u[position] = mid
        accepted = len(verify_with_uniforms(draft_ids, draft_probs, target_probs, u)) - 1
        lo, hi = (mid, hi) if accepted > position else (lo, mid)
    return lo


@pytest.mark.parametrize("params", WARPS, ids=str)
@pytest.mark.parametrize("gamma", [1, 3])
def test_first_token_law_is_warped_target_law(params, gamma):
    gen = torch.Generator().manual_seed(7)
    vocab = 8
    for trial in range(3):
        target_probs = warp(torch.randn(gamma + 1, vocab, generator=gen) * 2, params)
        draft_probs = warp(torch.randn(gamma, vocab, generator=gen) * 2, params)
        law = torch.zeros(vocab, dtype=torch.float64)
        for x in range(vocab):  # every possible first draft token, weighted by q(x)
            q_x = float(draft_probs[0, x])
            if q_x == 0:
                continue
            acc = accept_probability([x] * gamma, draft_probs, target_probs)
            p, q = target_probs[0].double(), draft_probs[0].double()
            residual = (p - q).clamp_min(0)
            residual_law = sampler_law(residual if residual.sum() > 0 else p)
            law += q_x * (acc * torch.nn.functional.one_hot(torch.tensor(x), vocab) + (1 - acc) * residual_law)
        assert torch.allclose(law, target_probs[0].double(), atol=1e-6), (law, target_probs[0])


def test_sampler_law_is_its_probs():
    probs = torch.tensor([0.1, 0.0, 0.25, 0.65])
    assert torch.allclose(sampler_law(probs), probs.double(), atol=1e-9)


def test_sampler_law_spans_blocks():
    """Many blocks of the two-level CDF, with zeros and empty blocks: the law is still the probs."""
    from exactspec.speculative.sampling import SAMPLE_BLOCK

    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(3 * SAMPLE_BLOCK + 17, generator=gen) ** 4
    probs[SAMPLE_BLOCK : 2 * SAMPLE_BLOCK] = 0  # an empty block
    probs[torch.rand(probs.shape, generator=gen) < 0.3] = 0
    probs[-1] = 0.05
    law = sampler_law(probs)
    assert torch.allclose(law, (probs / probs.sum()).double(), atol=1e-9)
    assert law[probs == 0].abs().max() == 0


def test_sampler_never_returns_a_zero_probability_token():
    """Zeros at both ends and between, unnormalised mass, u at 0 and as close to 1 as float64 gets."""
    probs = torch.tensor([0.0, 0.3, 0.0, 1e-30, 0.7, 0.0, 0.0])
    for scale in (1, 3):
        assert [sample_from_uniform(probs * scale, u) for u in (0.0, 0.5, 1 - 2**-53, 0.99999999)] == [1, 4, 4, 4]
    tiny = torch.tensor([1e-30, 0.0, 1.0])  # a tiny first token is reachable: the float64 CDF keeps it
    assert sample_from_uniform(tiny, 1e-31) == 0
    with pytest.raises(ValueError):
        sample_from_uniform(torch.zeros(5), 0.5)


def test_point_mass_drafts_keep_target_law():
    """q = one-hot(x): accept with p(x), else sample p with x removed — the law is still p."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target_probs = p.expand(2, 4).clone()
    law = torch.zeros(4, dtype=torch.float64)
    x = 2
    acc = accept_probability([x], None, target_probs)
    law[x] += acc
    law += (1 - acc) * sampler_law(p.clone().index_fill_(0, torch.tensor([x]), 0.0))
    assert abs(acc - 0.3) < 1e-7  # 0.3 in float32
    assert torch.allclose(law, p.double(), atol=1e-6)


@pytest.mark.parametrize("point_mass", [False, True])
def test_equals_reference(point_mass):
    gen = torch.Generator().manual_seed(0)
    cases, gamma, vocab = 64, 4, 6
    target_probs = torch.randn(cases, gamma + 1, vocab, generator=gen).softmax(-1)
    draft_probs = torch.randn(cases, gamma, vocab, generator=gen).softmax(-1)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(cases, gamma)
    uniforms = torch.rand(cases, gamma + 1, generator=gen)
    accepted = []
    for c in range(cases):
        q = None if point_mass else draft_probs[c]
        got = verify_with_uniforms(draft_ids[c].tolist(), q, target_probs[c], uniforms[c])
        assert got == verify_reference(draft_ids[c].tolist(), q, target_probs[c], uniforms[c].tolist())
        accepted.append(len(got) - 1)
    assert 0 < sum(accepted) < cases * gamma  # the case mix covered both outcomes


def test_all_accepted_gives_bonus_from_last_target_position():
    target_probs = torch.tensor([[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]])
    assert verify([1, 2], None, target_probs, torch.Generator().manual_seed(0)) == [1, 2, 3]


def test_first_rejected_samples_from_residual():
    target_probs = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    draft_probs = torch.tensor([[0.5, 0.0, 0.5]])
    assert verify([2], draft_probs, target_probs, torch.Generator().manual_seed(0)) == [1]


def test_empty_proposal_is_a_plain_sample():
    assert verify([], None, torch.tensor([[0.0, 0.0, 1.0]])) == [2]


def test_greedy_is_exact_match():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    assert verify([1, 1], None, warp(logits, SamplingParams(temperature=0))) == [1, 0]


def test_seeded_determinism():
    gen = torch.Generator().manual_seed(3)
    target_probs = torch.randn(4, 10, generator=gen).softmax(-1)
    draft_probs = torch.randn(3, 10, generator=gen).softmax(-1)
    ids = torch.randint(0, 10, (3,), generator=gen).tolist()
    runs = [verify(ids, draft_probs, target_probs, torch.Generator().manual_seed(11)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        verify([0, 0], None, torch.rand(2, 5))


def test_greedy_fast_path_equals_verify_on_one_hot_laws():
    gen = torch.Generator().manual_seed(4)
    cases, gamma, vocab = 200, 5, 4  # small vocab: every acceptance length occurs
    logits = torch.randn(cases, gamma + 1, vocab, generator=gen)
    corrupt = torch.rand(cases, gamma, generator=gen) < 0.3  # drafts mostly right, sometimes wrong
    draft_ids = torch.where(corrupt, torch.randint(0, vocab, (cases, gamma), generator=gen), logits[:, :gamma].argmax(-1))
    accepted = set()
    for c in range(cases):
        expected = verify(draft_ids[c].tolist(), None, warp(logits[c], SamplingParams(temperature=0)), gen)
        assert accept_greedy(draft_ids[c].tolist(), logits[c].argmax(-1).tolist()) == expected
        accepted.add(len(expected) - 1)
    assert accepted == set(range(gamma + 1))
