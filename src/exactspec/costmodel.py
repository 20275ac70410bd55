"""A cost model that knows verification is not free, and the γ policy built on it.

Theorem 3.8 assumes scoring γ+1 tokens costs one target step. On CPUs (and for small models) it
does not: T(k), the time of one target forward over k new tokens, grows with k. The predicted
speed-up for acceptance rate α is

    E[tokens per iteration] / ((γ · t_draft + T(γ+1)) / T(1)),

which is Theorem 3.8 when T is flat and t_draft = c · T(1).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .device import device_of, synchronize
from .models.base import CausalLM
from .theory import expected_tokens


TARGET_WEIGHT = 0.2  # how far one real iteration moves T(k)


@dataclass
class CostModel:
    target_s: list[float]  # [K]: seconds of one iteration over k = 1..K new tokens: measured, then refined
    draft_s_per_token: float = 0.0  # seconds the drafter spends per proposed token
    draft_observations: int = 0  # proposals that refined draft_s_per_token
    target_observations: list[int] = field(default_factory=list)  # [K]: real iterations that refined T(k)
    frozen: bool = False  # never refined: γ choices that do not depend on timing (tests)

    def __post_init__(self) -> None:
        if not self.target_observations:
            self.target_observations = [0] * len(self.target_s)

    @property
    def max_gamma(self) -> int:
        return len(self.target_s) - 1

    def observe_draft(self, seconds_per_token: float) -> None:
        """Refine the drafter's cost from real proposals: the first replaces the one-off measurement,
        later ones move it by 20%."""
        if self.frozen:
            return
        weight = 1.0 if self.draft_observations == 0 else 0.2
        self.draft_s_per_token += weight * (seconds_per_token - self.draft_s_per_token)
        self.draft_observations += 1

    def observe_target(self, k: int, seconds: float) -> None:
        """Refine T(k) from one real iteration over k new tokens (forward + verification, timed by the
        decode loop). `measure_target` runs at one context length without the loop's bookkeeping; real
        decoding differs: on llama.cpp, attention over a 500-token grounded prompt took T(2)/T(1) to
        ~1.4 and T(3)/T(1) to ~1.9 where the measurement said 1.3 and 1.65. Each observation (clipped
        to [0.5, 2]x, against outliers) moves T(k) by TARGET_WEIGHT; a k never observed keeps its
        measured ratio to T(1)."""
        if self.frozen or not 1 <= k <= len(self.target_s):
            return
        old = self.target_s[k - 1]
        new = old + TARGET_WEIGHT * (min(max(seconds, 0.5 * old), 2.0 * old) - old)
        self.target_s[k - 1] = new
        self.target_observations[k - 1] += 1
        if k == 1:
            for j, seen in enumerate(self.target_observations[1:], start=1):
                if not seen:
                    self.target_s[j] *= new / old

    def ratios(self) -> list[float]:
        """T(k) / T(1) for k = 1..K."""
        return [t / self.target_s[0] for t in self.target_s]

    def step_cost(self, gamma: int) -> float:
        """Cost of one iteration with γ drafts, in units of one plain target step."""
        return (gamma * self.draft_s_per_token + self.target_s[gamma]) / self.target_s[0]

    def predicted_speedup(self, alpha: float, gamma: int) -> float:
        return expected_tokens(alpha, gamma) / self.step_cost(gamma)

    def best_gamma(self, alpha: float) -> int:
        """The γ (0 = plain decoding) with the highest predicted speed-up; ties go to the smaller γ."""
        return max(range(self.max_gamma + 1), key=lambda g: (self.predicted_speedup(alpha, g), -g))

    def to_dict(self) -> dict:
        return {**asdict(self), "target_ratios": self.ratios()}


def measure_target(model: CausalLM, max_k: int = 9, context: int = 100, reps: int = 5) -> list[float]:
    """Median seconds of a forward over k = 1..max_k new tokens on a warm cache of `context` tokens.
    The k values are interleaved across repetitions so machine noise spreads over all of them."""
    gen = torch.Generator().manual_seed(0)
    model.reset()
    model.forward(torch.randint(0, model.vocab_size, (1, context), generator=gen))
    times: list[list[float]] = [[] for _ in range(max_k)]
    for rep in range(reps + 1):
        for k in range(1, max_k + 1):
            ids = torch.randint(0, model.vocab_size, (1, k), generator=gen)
            t = time.perf_counter()
            model.forward(ids)
            synchronize(device_of(model))
            if rep:  # the first round warms up
                times[k - 1].append(time.perf_counter() - t)
            model.truncate(context)
    model.reset()
    return [statistics.median(ts) for ts in times]


class AutoGamma:
    """Chooses γ before every iteration from the cost model and an online estimate of α.

    α is the posterior mean of a Beta prior updated with per-token outcomes (each accepted draft is a
    success, the first rejection a failure). While the best γ is 0 the loop decodes plainly and probes
    with γ=1 now and then, with the gap doubling after each probe that still says "don't speculate",
    so a losing drafter costs a vanishing fraction of the steps. Speculation must be predicted to win
    by `min_gain` before it is used: measured costs are noisy and the per-iteration bookkeeping
    (warping γ+1 rows, verifying) is not in T(k).
    """

    def __init__(self, cost: CostModel, prior_alpha: float = 0.3, prior_strength: float = 4.0,
                 first_probe: int = 8, min_gain: float = 1.05):
        self.cost, self.min_gain = cost, min_gain
        self.successes = prior_alpha * prior_strength
        self.failures = (1.0 - prior_alpha) * prior_strength
        self.probe_gap, self.plain_steps = first_probe, 0

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def next_gamma(self) -> int:
        gamma = self.cost.best_gamma(self.alpha)
        if gamma > 0 and self.cost.predicted_speedup(self.alpha, gamma) >= self.min_gain:
            return gamma
        self.plain_steps += 1
        if self.plain_steps >= self.probe_gap:
            self.plain_steps, self.probe_gap = 0, self.probe_gap * 2
            return 1
        return 0

    def observe_step(self, k: int, seconds: float) -> None:
        """One iteration over k new tokens (the last context token and k-1 drafts) took `seconds`."""
        self.cost.observe_target(k, seconds)

    def observe(self, proposed: int, accepted: int, draft_s: float | None = None) -> None:
        """Outcome of one proposal; `draft_s` (its drafting time) refines the drafter's measured cost,
        which a one-off measurement on a busy machine can get badly wrong."""
        if proposed:
            self.successes += accepted
            self.failures += accepted < proposed
            if draft_s is not None:
                self.cost.observe_draft(draft_s / proposed)


def measure_drafter(drafter, vocab_size: int, params, k: int = 4, context: int = 100, reps: int = 5) -> float:
    """Median seconds per proposed token of `drafter` on a context that repeats itself (so that
    prompt lookup finds matches, as on grounded prompts)."""
    gen = torch.Generator().manual_seed(0)
    half = torch.randint(0, vocab_size, (context // 2,), generator=gen).tolist()
    ctx = half + half
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        proposal = drafter.propose(ctx, k, params, gen)
        times.append((time.perf_counter() - t) / max(len(proposal), 1))
    return statistics.median(times)
