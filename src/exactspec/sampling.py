"""Sampling parameters and the warp that turns logits into the distribution actually sampled.

Exactness rests on one rule: the SAME `warp` is applied to target and draft logits before the
speculative accept test, so the verifier preserves the *warped* target law. Order follows Hugging
Face `generate`: temperature -> top-k -> top-p -> min-p. `temperature == 0` means greedy, which is
represented as a one-hot distribution so greedy is just the general rule on point masses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a distribution. Defaults sample from the raw model (T=1)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables

    def __post_init__(self) -> None:
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (float32), the distribution to sample from."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        drop_sorted = mass_before >= params.top_p  # the first token is never dropped
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_uniform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs [B, V] (need not be normalised), uniform [B] in [0, 1) -> ids [B].

    Deterministic given the uniforms, so the verifier stays a pure function of its random numbers.
    A zero-probability token is never returned.
    """
    cdf = probs.double().cumsum(-1)  # [B, V]
    target = uniform.double() * cdf[:, -1]  # [B]
    idx = (cdf <= target[:, None]).sum(-1)  # first index whose cdf exceeds target
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last_positive)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [B, V] -> ids [B]."""
    return sample_from_uniform(probs, torch.rand(probs.shape[0], generator=generator))
