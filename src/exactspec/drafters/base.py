"""The drafter interface: propose up to k tokens (with the law they were drawn from), then hear the outcome.

Drafters never see the target model. The verifier only needs each proposed token and the draft
probabilities it was sampled from (or none, for deterministic point-mass proposals such as prompt
lookup). A drafter with nothing to propose returns an empty proposal and the loop takes a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling import SamplingParams


@dataclass
class Proposal:
    ids: torch.Tensor  # [k] long, k may be 0
    probs: torch.Tensor | None  # [k, V] warped draft probs, or None for point masses
    match: int = 0  # copying drafters: context tokens before the proposal that agree with its source

    @classmethod
    def empty(cls) -> "Proposal":
        return cls(torch.zeros(0, dtype=torch.long), None)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def head(self, n: int) -> "Proposal":
        """The first n tokens."""
        return Proposal(self.ids[:n], None if self.probs is None else self.probs[:n], self.match)


class Drafter(Protocol):
    name: str
    copies: bool  # True: proposals are copies with a match length; auto γ may cut them to any prefix

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None, law=None
    ) -> Proposal:
        """Up to k tokens to follow `context` (prompt + everything emitted so far). A stochastic drafter
        given `law` (constraints.TargetLaw: grammar mask, penalties) samples from
        `law.draft_probs(logits, context + drafts so far)` instead of `warp(logits, params)`."""
        ...

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """Outcome of the last proposal; drafters may adapt. Default drafters ignore it."""
        ...
