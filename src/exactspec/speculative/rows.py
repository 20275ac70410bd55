"""A row: one sequence of a batch, and one iteration's proposal for it (speculative/loop.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..stats import Stats
from .params import sampling_mode
from .interfaces import Copies, Drafter, GammaPolicy, Lookups
from .law import TargetLaw
from .sampling import SamplingParams, Uniforms


@dataclass(eq=False)
class Row:
    """One sequence of a batch, with everything that makes it decode exactly as it would alone."""

    key: object  # the caller's handle (decode_batch: the row's index)
    prompt: list[int]
    drafter: Drafter | None
    params: SamplingParams
    gamma: int | GammaPolicy  # a shared policy is asked once per iteration for all its rows
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
    # what propose.py asks of the row every iteration, fixed for its life (drafter, γ, law and params are)
    copying: bool = field(init=False)  # auto γ cuts its proposals after drafting: a copying drafter under a policy
    own_copies: bool = field(init=False)  # ... copying from its own context alone, with no law (`next_lookup`)
    mode: str = field(init=False)  # "greedy" or "sampled" (params.sampling_mode)

    def __post_init__(self) -> None:
        self.context = list(self.prompt)
        self.copier = self.drafter if isinstance(self.drafter, Copies) else None
        self.lookups = self.drafter if isinstance(self.drafter, Lookups) else None
        auto = not isinstance(self.gamma, int)
        self.copying = auto and self.drafter is not None and self.drafter.copies
        self.own_copies = (auto and self.law is None and self.lookups is not None
                           and self.lookups.sources == ("context",))
        self.mode = sampling_mode(self.params)
        self.uniforms = Uniforms(self.generator)
        self.stats.lenience = min(self.stats.lenience, self.params.lenience)
        self._decode_base = self.stats.decode_s  # a Stats carried over from earlier generations keeps its time


class Draft(NamedTuple):
    """One row's proposal for one iteration."""

    ids: list[int]  # [k] grammar-forced tokens first, then the drafter's
    probs: torch.Tensor | None  # [k, V] the laws they were drawn from; None: point masses
    forced: int  # how many lead ids are grammar-forced
    match: int  # copying drafters: the match length behind the proposal (auto γ's evidence)
    seconds: float  # time spent drafting
    kind: object = None  # copying drafters: (source, sampled) of the copy (acceptance.Acceptance.of)
