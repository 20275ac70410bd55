"""An engine's drafters: which drafter a name means, the γ policy each generation gets (a fixed γ, or auto
γ over what the engine has learned: `autogamma.learned`), the store of earlier outputs and the auto
drafter's bandit. The engine owns one `Drafting`; every generation asks it for a fresh drafter and a policy."""

from __future__ import annotations

import time

import torch

from .autogamma.costs import MAX_AUTO_GAMMA, CostModel
from .autogamma.learned import Learned
from .drafters import STORE_MB
from .drafters.auto import AutoDrafter, DraftBandit
from .drafters.model import ModelDrafter
from .drafters.ngram import NGramDrafter
from .drafters.prompt_indexes import PromptIndexes
from .drafters.suffix import PromptLookupDrafter, SuffixDrafter
from .drafters.suffix_index import SuffixIndex
from .drafters.source import read_source
from .errors import ExactSpecError
from .models.seq2seq import Seq2SeqLM
from .speculative.fixed_gamma import FixedGamma
from .speculative.interfaces import CausalLM, Drafter, GammaPolicy, PricesArms
from .speculative.params import DRAFT_NAMES
from .stats import Stats

AUTO_ARMS = ("prompt-lookup", "store", "bigram")  # "store" when the engine has one, "model" when it has a draft model


class Drafting:
    """Drafters by name over one target (and draft model), and what auto γ / auto draft learn (`learned`)."""

    def __init__(self, target: CausalLM, draft_model: CausalLM | None = None, prior_alpha: float = 0.3,
                 store_mb: float = STORE_MB):
        self.target, self.draft_model = target, draft_model
        self.store: SuffixIndex | None = None  # earlier requests' and running siblings' outputs (drafters/suffix.py)
        self.set_store(store_mb)
        self.prompts = PromptIndexes()  # recent prompts' indexes: a prompt that begins with one copies it
        self.learned = Learned(target, prior_alpha)  # auto γ's costs, acceptance and probes, across requests
        self._bandit: DraftBandit | None = None  # what `draft="auto"` learned, kept across requests

    def set_store(self, budget_mb: float | None) -> None:
        """A fresh, empty store of at most `budget_mb` MiB for the suffix drafter (None or 0: none; it
        then copies from each request's own context only, as prompt lookup does)."""
        if budget_mb is not None and budget_mb < 0:
            raise ExactSpecError(f"the store budget must be >= 0 MiB, got {budget_mb}")
        self.store = SuffixIndex(budget_mb) if budget_mb else None

    def make(self, draft: str, policy: GammaPolicy | None = None) -> Drafter | None:
        """A fresh drafter (drafters hold per-request state); None for "none". The auto drafter prices
        its arms by the generation's auto-γ `policy`, if it has one."""
        if draft == "none":
            return None
        if draft == "prompt-lookup":
            return PromptLookupDrafter(prompts=self.prompts)
        if draft == "suffix":
            return SuffixDrafter(self.store, prompts=self.prompts)
        if draft in ("bigram", "unigram"):
            return NGramDrafter(self.target.vocab_size, order=2 if draft == "bigram" else 1)
        if draft == "model" and self.draft_model is not None:
            return ModelDrafter(self.draft_model)
        if draft == "store" and self.store is not None:  # the store alone (an arm of auto)
            return SuffixDrafter(self.store, own_context=False)
        if draft == "auto":
            arms = [a for a in AUTO_ARMS if a != "store" or self.store is not None]
            arms += ["model"] if self.draft_model is not None else []
            return AutoDrafter(self.bandit(), {name: self.make(name) for name in arms},
                               policy if isinstance(policy, PricesArms) else None)
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a model path")

    def bandit(self) -> DraftBandit:
        """The `auto` drafter's knowledge (acceptance and cost per drafter), over the target's T(k)."""
        if self._bandit is None:
            self.cost_model("none")  # measures T(k) once (shared by every cost model)
            self._bandit = DraftBandit(self.learned.target_s)
        return self._bandit

    @property
    def target_measured(self) -> bool:
        """Whether the target's T(k) is known (until then, building an auto-γ row measures it: the
        target's cache is reset)."""
        return self.learned.target_measured

    def uses_draft_model(self, draft: str) -> bool:
        """Whether generations with `draft` run the draft model (one sequence at a time: it has one cache)."""
        return draft == "model" or (draft == "auto" and self.draft_model is not None)

    def cost_model(self, draft: str, max_gamma: int = MAX_AUTO_GAMMA) -> CostModel:
        """Auto γ's prices for `draft` (`Learned.cost_model`: measured once, refined as it decodes); an
        encoder-decoder target reads a random source first, so that its decoder has one to attend to."""
        if isinstance(self.target, Seq2SeqLM) and not self.learned.priced(draft):
            self.set_source(torch.randint(0, self.target.vocab_size, (64,),
                                          generator=torch.Generator().manual_seed(0)).tolist())
        return self.learned.cost_model(draft, self.make, max_gamma)

    def policy(self, gamma: int | str, draft: str, views: dict | None = None) -> tuple[Drafter | None, GammaPolicy]:
        """A fresh drafter and the γ policy for one generation: a `FixedGamma`, or for "auto" an AutoGamma
        over what the engine learned (`Learned.policy`; `views`: a request's, `generation.Request.views`).
        γ = 0, or no drafter and no grammar, is plain decoding."""
        if gamma == "auto" and draft != "none":
            policy = self.learned.policy(draft, self.cost_model(draft), views)
            return self.make(draft, policy), policy
        fixed = 1 if gamma == "auto" else gamma  # no drafter: only grammar-forced drafts, which γ does not budget
        return (self.make(draft) if fixed != 0 else None), FixedGamma(fixed)

    def set_source(self, source_ids: list[int]) -> None:
        """Encoder-decoder pair: run the target's (and the draft model's) encoder over the source."""
        self.target.set_source(source_ids)
        if self.draft_model is not None:
            self.draft_model.set_source(source_ids)

    def read_source(self, source_ids: list[int], drafter: Drafter | None,
                    stats: Stats) -> tuple[Drafter | None, list[int]]:
        """Encoder-decoder generation: the encoders read the source (timed as prefill), and so do the
        context drafters; -> (the drafter, the decoder's prompt: its start tokens)."""
        t = time.perf_counter()
        self.set_source(source_ids)
        stats.prefill_s += time.perf_counter() - t
        if drafter is not None:
            drafter = read_source(drafter, source_ids, len(self.target.decoder_prompt), self.target.eos_token_ids)
        return drafter, self.target.decoder_prompt
