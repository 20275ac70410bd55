"""The verifier alone: its law is the target law, it matches the reference loop, rows are independent."""

from __future__ import annotations

import pytest
import torch

from exactspec.sampling import SamplingParams, sample_from_uniform, warp
from exactspec.verify import PAD, verify, verify_reference, verify_with_uniforms

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
            if int(sample_from_uniform(probs[None], torch.tensor([mid], dtype=torch.float64))[0]) <= j:
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
        u = torch.zeros(1, draft_ids.shape[1] + 1, dtype=torch.float64)
        u[0, position] = mid
        _, n = verify_with_uniforms(draft_ids, draft_probs, target_probs, u)
        lo, hi = (mid, hi) if int(n[0]) > position else (lo, mid)
    return lo


@pytest.mark.parametrize("params", WARPS, ids=str)
@pytest.mark.parametrize("gamma", [1, 3])
def test_first_token_law_is_warped_target_law(params, gamma):
    gen = torch.Generator().manual_seed(7)
    vocab = 8
    for trial in range(3):
        target_probs = warp(torch.randn(1, gamma + 1, vocab, generator=gen) * 2, params)
        draft_probs = warp(torch.randn(1, gamma, vocab, generator=gen) * 2, params)
        law = torch.zeros(vocab, dtype=torch.float64)
        for x in range(vocab):  # every possible first draft token, weighted by q(x)
            q_x = float(draft_probs[0, 0, x])
            if q_x == 0:
                continue
            ids = torch.full((1, gamma), x)
            acc = accept_probability(ids, draft_probs, target_probs)
            p, q = target_probs[0, 0].double(), draft_probs[0, 0].double()
            residual = (p - q).clamp_min(0)
            residual_law = sampler_law(residual if residual.sum() > 0 else p)
            law += q_x * (acc * torch.nn.functional.one_hot(torch.tensor(x), vocab) + (1 - acc) * residual_law)
        assert torch.allclose(law, target_probs[0, 0].double(), atol=1e-6), (law, target_probs[0, 0])


def test_sampler_law_is_its_probs():
    probs = torch.tensor([0.1, 0.0, 0.25, 0.65])
    assert torch.allclose(sampler_law(probs), probs.double(), atol=1e-9)


def test_point_mass_drafts_keep_target_law():
    """q = one-hot(x): accept with p(x), else sample p with x removed — the law is still p."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target_probs = p.expand(1, 2, 4).clone()
    law = torch.zeros(4, dtype=torch.float64)
    x = 2
    acc = accept_probability(torch.tensor([[x]]), None, target_probs)
    law[x] += acc
    law += (1 - acc) * sampler_law(p.clone().index_fill_(0, torch.tensor([x]), 0.0))
    assert abs(acc - 0.3) < 1e-7  # 0.3 in float32
    assert torch.allclose(law, p.double(), atol=1e-6)


@pytest.mark.parametrize("point_mass", [False, True])
def test_batched_equals_reference_per_row(point_mass):
    gen = torch.Generator().manual_seed(0)
    batch, gamma, vocab = 64, 4, 6
    target_probs = torch.randn(batch, gamma + 1, vocab, generator=gen).softmax(-1)
    draft_probs = torch.randn(batch, gamma, vocab, generator=gen).softmax(-1)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, gamma)
    uniforms = torch.rand(batch, gamma + 1, generator=gen)
    q = None if point_mass else draft_probs
    tokens, n = verify_with_uniforms(draft_ids, q, target_probs, uniforms)
    for b in range(batch):
        expected = verify_reference(draft_ids[b].tolist(), None if q is None else q[b], target_probs[b], uniforms[b].tolist())
        assert tokens[b, : n[b] + 1].tolist() == expected
        assert (tokens[b, n[b] + 1 :] == PAD).all()
        one, n_one = verify_with_uniforms(draft_ids[b : b + 1], None if q is None else q[b : b + 1], target_probs[b : b + 1], uniforms[b : b + 1])
        assert one[0].tolist() == tokens[b].tolist() and int(n_one[0]) == int(n[b])
    assert 0 < int(n.sum()) < batch * gamma  # the case mix covered both outcomes


def test_all_accepted_gives_bonus_from_last_target_position():
    target_probs = torch.tensor([[[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]]])
    tokens, n = verify(torch.tensor([[1, 2]]), None, target_probs, torch.Generator().manual_seed(0))
    assert n.tolist() == [2] and tokens.tolist() == [[1, 2, 3]]


def test_first_rejected_samples_from_residual():
    target_probs = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    draft_probs = torch.tensor([[[0.5, 0.0, 0.5]]])
    tokens, n = verify(torch.tensor([[2]]), draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert n.tolist() == [0] and tokens.tolist() == [[1, PAD]]


def test_empty_proposal_is_a_plain_sample():
    target_probs = torch.tensor([[[0.0, 0.0, 1.0]]])
    tokens, n = verify(torch.zeros(1, 0, dtype=torch.long), None, target_probs)
    assert n.tolist() == [0] and tokens.tolist() == [[2]]


def test_greedy_is_exact_match():
    logits = torch.tensor([[[0.1, 3.0, 0.2], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
    target_probs = warp(logits, SamplingParams(temperature=0))
    tokens, n = verify(torch.tensor([[1, 1]]), None, target_probs)
    assert n.tolist() == [1] and tokens.tolist() == [[1, 0, PAD]]


def test_seeded_determinism():
    gen = torch.Generator().manual_seed(3)
    target_probs = torch.randn(8, 4, 10, generator=gen).softmax(-1)
    draft_probs = torch.randn(8, 3, 10, generator=gen).softmax(-1)
    ids = torch.randint(0, 10, (8, 3), generator=gen)
    a = verify(ids, draft_probs, target_probs, torch.Generator().manual_seed(11))
    b = verify(ids, draft_probs, target_probs, torch.Generator().manual_seed(11))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        verify(torch.zeros(1, 2, dtype=torch.long), None, torch.rand(1, 2, 5))


def test_greedy_fast_path_equals_verify_on_one_hot_laws():
    from exactspec.verify import verify_greedy

    gen = torch.Generator().manual_seed(4)
    batch, gamma, vocab = 200, 5, 4  # small vocab: every acceptance length occurs
    logits = torch.randn(batch, gamma + 1, vocab, generator=gen)
    corrupt = torch.rand(batch, gamma, generator=gen) < 0.3  # drafts mostly right, sometimes wrong
    draft_ids = torch.where(corrupt, torch.randint(0, vocab, (batch, gamma), generator=gen), logits[:, :gamma].argmax(-1))
    expected = verify(draft_ids, None, warp(logits, SamplingParams(temperature=0)), gen)
    tokens, n = verify_greedy(draft_ids, logits.argmax(-1))
    assert torch.equal(tokens, expected[0]) and torch.equal(n, expected[1])
    assert set(n.tolist()) == set(range(gamma + 1))
