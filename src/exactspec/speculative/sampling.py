"""The warp that turns logits into the distribution actually sampled (its parameters: `params.py`).

Exactness rests on one rule: the SAME `warp` is applied to target and draft logits before the
speculative accept test, so the verifier preserves the *warped* target law. Order follows Hugging
Face `generate`: temperature -> top-k -> top-p -> min-p. `temperature == 0` means greedy, which is
represented as a one-hot distribution so greedy is just the general rule on point masses.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import ArrayLike

from ..errors import ExactSpecError
from .params import MIN_TEMPERATURE, SamplingParams  # noqa: F401 (the settings live torch-free in params.py)

def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (float32), the distribution to sample from."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits.float() if params.temperature == 1 else logits.float() / params.temperature
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


class LawError(ExactSpecError):
    """A row's law is not a probability distribution: that row fails, its neighbours go on."""

    def __init__(self) -> None:
        super().__init__("the sampling law is not a probability distribution (NaN or no mass): check temperature, "
                         "penalties and logit_bias")


def bad_laws(probs: torch.Tensor, widths: torch.Tensor | None = None) -> torch.Tensor:
    """probs [A, K+1, V] (or [K+1, V]) -> the indices of the rows (along A) whose laws, at their first
    `widths[a]` positions (all by default), are not distributions: a NaN or no mass. One host sync."""
    probs = probs if probs.dim() == 3 else probs[None]
    sums = probs.sum(-1)  # [A, K+1]
    used = torch.ones_like(sums, dtype=torch.bool) if widths is None else \
        torch.arange(sums.shape[1], device=sums.device)[None] < widths[:, None]
    return torch.nonzero((~(sums > 0) & used).any(-1)).flatten()


def as_numpy(x: ArrayLike) -> np.ndarray:
    """A CPU tensor as an ndarray over the same memory (no copy); anything else through np.asarray."""
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


SAMPLE_BLOCK = 256  # tokens per block of the two-level CDF in sample_from_uniform


def sample_from_uniform(probs: ArrayLike, uniform: float) -> int:
    """Inverse-CDF sampling of one token: probs [V] (need not be normalised), uniform in [0, 1) -> id.

    Deterministic given the uniform, so the verifier stays a pure function of its random numbers.
    The CDF is float64 (no tiny probability is absorbed) and two-level: block sums first, then a running
    sum inside the one block that holds the point (NumPy's cumsum over all V costs ~5x more). A
    zero-probability token is never returned: the point u * total stays strictly below the total, and
    the index found is a step of the CDF.
    """
    p = as_numpy(probs)  # [V]
    starts = np.arange(0, len(p), SAMPLE_BLOCK)
    block_cdf = np.cumsum(np.add.reduceat(p, starts, dtype=np.float64))  # [ceil(V / BLOCK)]
    total = block_cdf[-1]
    if not total > 0:
        raise ValueError(f"cannot sample from probabilities that sum to {total}")
    point = min(float(uniform) * total, np.nextafter(total, 0.0))
    j = int(np.searchsorted(block_cdf, point, side="right"))  # block_cdf[j] > point >= block_cdf[j - 1]
    block = p[starts[j]:starts[j] + SAMPLE_BLOCK]
    cdf = (block_cdf[j - 1] if j else 0.0) + np.cumsum(block, dtype=np.float64)
    i = int(np.searchsorted(cdf, point, side="right"))
    if i == len(block):  # the block's own running sum rounded below its block sum: its last positive token
        i = int(np.flatnonzero(block > 0)[-1])
    return int(starts[j]) + i


def draw_uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    """n uniforms in [0, 1) from `generator` (host RNG): every random number of the decode loop (its
    verifier's, through `Uniforms`, and the sampling drafters', through `sample`) is drawn here, so that
    one seam replaces them all (tests/helpers/exact_law.py enumerates their outcomes to find the loop's exact law)."""
    return torch.rand(n, generator=generator).tolist()


class Uniforms:
    """A row's random numbers for acceptance and sampling, in the order of the positions they decide:
    drawn from its generator as needed, and those an iteration did not use (positions after the first
    rejection) handed back for the next one. So the uniform of output position t is the t-th number
    drawn, whatever the proposals were (torch's CPU generator gives the same numbers however the draws
    are split): a point-mass proposal verified by `verify.verify_coupled` then leaves the sampled text
    exactly as plain decoding from the same seed would give it."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator, self.pending = generator, []

    def take(self, n: int) -> list[float]:
        fresh = n - len(self.pending)
        out = self.pending[:n] + (draw_uniforms(fresh, self.generator) if fresh > 0 else [])
        self.pending = self.pending[n:]
        return out

    def unread(self, unused: list[float]) -> None:
        self.pending = list(unused) + self.pending


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """probs [V] -> one id, drawn with one uniform from `generator` (host RNG on every device)."""
    uniform = draw_uniforms(1, generator)[0]
    if probs.device.type != "cpu":  # the same float32 number torch.rand gave
        return int(sample_rows(probs[None], torch.tensor([uniform], device=probs.device))[0])
    return sample_from_uniform(probs, uniform)


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling per row: probs [A, V] (need not be normalised), uniforms [A] -> ids [A].
    float64 CDF; the point u * total stays strictly below the total, so a zero-probability token is
    never returned (the first index whose CDF exceeds the point is a step of the CDF)."""
    cdf = probs.double().cumsum(-1)  # [A, V]
    total = cdf[:, -1:]
    point = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)

