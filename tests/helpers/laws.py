"""Monte-Carlo exactness: continuations of a tiny model's prompt sampled through the loop (batched rows),
the exact warped target law they must follow, and a pooled chi-square test with its negative controls."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare

from exactspec.drafters.model import ModelDrafter
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.models.torch_hf import HFCausalLM
from exactspec.speculative.loop import decode, decode_batch
from exactspec.speculative.sampling import SamplingParams, warp
from exactspec.speculative.verify import verify
from exactspec.stats import Stats

from ..conftest import TINY_VOCAB

PROMPT = [3, 5, 2, 3, 5]


LENGTH = 3  # tokens per continuation -> TINY_VOCAB**3 = 512 outcomes


SAMPLES = 3000


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
