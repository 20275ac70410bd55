"""A row: one sequence of a batch, and one iteration's proposal for it (speculative/loop.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..stats import Stats
from .params import sampling_mode
from .fixed_gamma import FixedGamma
from .interfaces import Copies, CutsCopies, Drafter, GammaPolicy, Lookups, SpacesLookups
from .law import TargetLaw
from .sampling import SamplingParams, Uniforms


@dataclass(eq=False)
class Row:
    """One sequence of a batch, with everything that makes it decode exactly as it would alone."""

    key: object  # the caller's handle (decode_batch: the row's index)
    prompt: list[int]
    drafter: Drafter | None
    params: SamplingParams
    gamma: GammaPolicy  # a shared policy is asked once per iteration for all its rows
    max_new_tokens: int
    generator: torch.Generator | None
    stats: Stats = field(default_factory=Stats)
    law: TargetLaw | None = None  # grammar / penalties / logprobs of this row (law.py)
    cancelled: bool = False  # set by the caller: the row leaves when the current iteration ends
    error: Exception | None = None  # this row failed alone (its drafting, law, acceptance): it leaves, tokens-less,
    # when the iteration ends; the batch's other rows go on untouched
    done: bool = False  # EOS, max_new_tokens or the context limit: it leaves when the iteration ends
    context: list[int] = field(init=False)
    produced: int = 0
    started: float = 0.0
    lookup_at: int = 0  # auto γ, a context-only copier: no lookup before the context is this long (next_lookup)
    rule: object = None  # its accept.Rule: how its drafts are accepted, set once when it joins a decoder
    uniforms: Uniforms = field(init=False)  # its random numbers by output position (drawn from `generator`)
    # the drafter as the optional protocols propose.py asks of it, checked once here (an isinstance on a
    # runtime protocol costs ~10 us: too much for every row of every iteration); None: it is not one
    copier: Copies | None = field(init=False)
    lookups: Lookups | None = field(init=False)
    # what propose.py asks of the row every iteration, fixed for its life (drafter, γ, law and params are):
    # its policy as the optional protocols it asks of it, checked once here as the drafter's; None: not one
    cuts: CutsCopies | None = field(init=False)  # its proposals are cut after drafting: a copying drafter under it
    spaces: SpacesLookups | None = field(init=False)  # ... copying from its own context alone, with no law (lookups.py)
    plain: bool = field(init=False)  # a fixed γ of 0: no drafts at all, not even grammar-forced ones
    mode: str = field(init=False)  # "greedy" or "sampled" (params.sampling_mode)

    def __post_init__(self) -> None:
        self.context = list(self.prompt)
        self.copier = self.drafter if isinstance(self.drafter, Copies) else None
        self.lookups = self.drafter if isinstance(self.drafter, Lookups) else None
        cuts = isinstance(self.gamma, CutsCopies) and self.drafter is not None and self.drafter.copies
        self.cuts = self.gamma if cuts else None
        own = self.law is None and self.lookups is not None and self.lookups.sources == ("context",)
        self.spaces = self.gamma if own and isinstance(self.gamma, SpacesLookups) else None
        self.plain = isinstance(self.gamma, FixedGamma) and self.gamma.plain
        self.mode = sampling_mode(self.params)
        self.uniforms = Uniforms(self.generator)
        self.stats.lenience = min(self.stats.lenience, self.params.lenience)
        self._decode_base = self.stats.decode_s  # a Stats carried over from earlier generations keeps its time

    @property
    def copying(self) -> bool:
        """Whether its policy cuts its proposals after drafting (`cuts`): a copying drafter under auto γ."""
        return self.cuts is not None


class Draft(NamedTuple):
    """One row's proposal for one iteration."""

    ids: list[int]  # [k] grammar-forced tokens first, then the drafter's
    probs: torch.Tensor | None  # [k, V] the laws they were drawn from; None: point masses
    forced: int  # how many lead ids are grammar-forced
    match: int  # copying drafters: the match length behind the proposal (auto γ's evidence)
    seconds: float  # time spent drafting
    kind: object = None  # copying drafters: (source, sampled) of the copy (acceptance.Acceptance.of)
