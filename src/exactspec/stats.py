"""Counters and timings of one generation (or many, merged)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import reduce


@dataclass
class Stats:
    target_calls: int = 0  # target forward passes after the prefill
    draft_calls: int = 0  # proposals requested from the drafter
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    rejections: int = 0  # iterations that ended on a rejected draft
    emitted: int = 0  # tokens produced (accepted + corrections/bonus)
    forced: int = 0  # grammar-forced tokens proposed (point-mass drafts, counted in `proposed`)
    forced_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: times draft i was accepted
    drafts_by: dict[str, int] = field(default_factory=dict)  # target calls with drafts, per drafter that made them
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_tokens: int = 0  # prompt tokens prefilled (computed)
    run_lengths: list[int] = field(default_factory=list)  # [n]: speculative iterations that accepted n drafts
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0  # time inside the drafter
    verify_s: float = 0.0  # time in target forward + verification
    lenience: float = 1.0  # the verifier's lenience (1 = exact; < 1 = lossy, see verify.py); merged: the smallest
    block_verified: int = 0  # target calls whose drafts were verified as a block (verification="block", real draft law)

    def record(self, proposed: int, accepted: int, emitted: int, drafter: str | None = None, forced: int = 0,
               forced_accepted: int = 0, block: bool = False) -> None:
        self.target_calls += 1
        self.block_verified += block
        if proposed and drafter is not None:
            self.drafts_by[drafter] = self.drafts_by.get(drafter, 0) + 1
        self.forced += forced
        self.forced_accepted += forced_accepted
        self.draft_calls += proposed > 0
        self.proposed += proposed
        self.accepted += accepted
        self.rejections += accepted < proposed
        self.emitted += emitted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        if proposed:
            if len(self.run_lengths) <= accepted:
                self.run_lengths += [0] * (accepted + 1 - len(self.run_lengths))
            self.run_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance under the paper's i.i.d. model: the maximum-likelihood estimate from
        truncated runs (accepted drafts are successes, each rejection one failure). Unlike
        `acceptance_rate` it is not biased down by drafts proposed after a rejection."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else None

    @property
    def tokens_per_target_call(self) -> float | None:
        return self.emitted / self.target_calls if self.target_calls else None

    @property
    def exact(self) -> bool:
        """False when a lenient (lossy) acceptance rule was used."""
        return self.lenience == 1

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float | None:
        return self.emitted / self.decode_s if self.decode_s > 0 else None

    def merge(self, other: "Stats") -> "Stats":
        out = Stats(**{k: v for k, v in asdict(self).items()
                       if k not in ("accepted_per_position", "drafts_by", "run_lengths")})
        out.drafts_by = {k: self.drafts_by.get(k, 0) + other.drafts_by.get(k, 0)
                         for k in {**self.drafts_by, **other.drafts_by}}
        for name in ("target_calls", "draft_calls", "proposed", "accepted", "rejections", "emitted",
                     "cached_tokens", "prefill_tokens", "forced", "forced_accepted", "block_verified"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("prefill_s", "decode_s", "draft_s", "verify_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.lenience = min(self.lenience, other.lenience)
        out.accepted_per_position = _add(self.accepted_per_position, other.accepted_per_position)
        out.run_lengths = _add(self.run_lengths, other.run_lengths)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            alpha=self.alpha,
            tokens_per_target_call=self.tokens_per_target_call,
            wall_s=self.wall_s,
            tokens_per_s=self.tokens_per_s,
            exact=self.exact,
        )
        return d


def _add(xs: list[int], ys: list[int]) -> list[int]:
    """Element-wise sum of two count lists of any lengths."""
    n = max(len(xs), len(ys))
    return [a + b for a, b in zip(xs + [0] * (n - len(xs)), ys + [0] * (n - len(ys)))]


def total(stats: Iterable[Stats]) -> Stats:
    """The sum of many generations' stats (empty: zeros)."""
    return reduce(Stats.merge, stats, Stats())
