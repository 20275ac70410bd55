"""A fixed γ as a policy: every iteration drafts up to γ tokens, whatever they cost; it learns nothing.
γ = 0 is plain decoding (no drafts at all, not even grammar-forced ones): our own baseline."""

from __future__ import annotations

from dataclasses import dataclass

from .interfaces import GammaPolicy


@dataclass(eq=False)
class FixedGamma:
    """`GammaPolicy` of a fixed γ: the budget is γ, the outcomes and timings go nowhere."""

    gamma: int
    depth: int | None = None  # set by propose for every policy; a fixed γ does not read it

    @property
    def plain(self) -> bool:
        """γ = 0: the row decodes plainly (propose asks neither the drafter nor the grammar for drafts)."""
        return self.gamma <= 0

    def budget(self, rows: int, copying: bool) -> int:
        return self.gamma

    def observe_step(self, k: int, seconds: float, batch: int = 1, lengths: list[int] | None = None,
                     depth: int | None = None) -> None:
        pass

    def observe(self, proposed: int, accepted: int, draft_s: float | None = None, match: int | None = None,
                kind: object = None) -> None:
        pass

    def finish(self) -> None:
        pass


def as_policy(gamma: int | GammaPolicy) -> GammaPolicy:
    """A γ given as drafts per iteration (a caller's plain number) or a policy -> a policy."""
    return gamma if isinstance(gamma, GammaPolicy) else FixedGamma(gamma)
