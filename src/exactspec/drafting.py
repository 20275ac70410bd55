"""An engine's drafters and γ policies: which drafter a name means, and what auto γ and the auto
drafter learn across requests (the target's T(k) and T(B, k), each drafter's cost and acceptance,
the bandit). The engine owns one `Drafting`; every generation asks it for a fresh drafter and a policy."""

from __future__ import annotations

import time

import torch

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
from .measure import measure_drafter, save_refined, target_costs
from .speculative.acceptance import Acceptance, RequestAcceptance
from .speculative.auto_gamma import AutoGamma, Probes
from .speculative.costs import MAX_AUTO_GAMMA, BatchCosts, CostModel, DepthCosts
from .speculative.interfaces import CausalLM, Drafter, RowContexts
from .speculative.params import DRAFT_NAMES
from .speculative.sampling import SamplingParams
from .stats import Stats

AUTO_ARMS = ("prompt-lookup", "store", "bigram")  # "store" when the engine has one, "model" when it has a draft model
COPYING = ("prompt-lookup", "suffix", "store", "auto")  # drafters auto γ cuts after a lookup: priced per proposal
MEASURED_DRAFT_K = 4  # the proposal length `measure_drafter` times
MIN_REFINED = 32  # iterations that refined T(k) before it is worth persisting (`Drafting.save_costs`)


class Drafting:
    """Drafters by name over one target (and draft model), and the state auto γ / auto draft keep."""

    def __init__(self, target: CausalLM, draft_model: CausalLM | None = None, prior_alpha: float = 0.3,
                 store_mb: float = STORE_MB):
        self.target, self.draft_model = target, draft_model
        self.store: SuffixIndex | None = None  # earlier requests' and running siblings' outputs (drafters/suffix.py)
        self.set_store(store_mb)
        self.prompts = PromptIndexes()  # recent prompts' indexes: a prompt that begins with one copies it
        self.prior_alpha = prior_alpha  # AutoGamma's prior acceptance rate (`exactspec tune` reports α per workload)
        self._target_costs: list[float] | None = None  # T(k), k = 1..K, and how often each was refined
        self._target_observations: list[int] = []
        self._target_extra_at: list[float] = []  # CostModel.extra_at, shared like the rest
        self._saved_iterations = 0  # refined iterations already persisted (`save_costs`)
        self._depth_costs = DepthCosts()  # T(k) at deeper contexts, refined like _target_costs
        self._batch_costs = BatchCosts()  # T(B, k), refined by batched auto-gamma iterations
        self._costs: dict[str, CostModel] = {}  # per drafter; AutoGamma refines them as it decodes
        self._acceptance: dict[str, Acceptance] = {}  # per drafter: α by match length, across requests
        self._probes: dict[str, Probes] = {}  # per drafter: auto γ's probe schedule, across requests
        self._bandit: DraftBandit | None = None  # what `draft="auto"` learned, kept across requests

    def set_store(self, budget_mb: float | None) -> None:
        """A fresh, empty store of at most `budget_mb` MiB for the suffix drafter (None or 0: none; it
        then copies from each request's own context only, as prompt lookup does)."""
        if budget_mb is not None and budget_mb < 0:
            raise ExactSpecError(f"the store budget must be >= 0 MiB, got {budget_mb}")
        self.store = SuffixIndex(budget_mb) if budget_mb else None

    def make(self, draft: str, policy: int | AutoGamma | None = None) -> Drafter | None:
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
                               policy if isinstance(policy, AutoGamma) else None)
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a model path")

    def bandit(self) -> DraftBandit:
        """The `auto` drafter's knowledge (acceptance and cost per drafter), over the target's T(k)."""
        if self._bandit is None:
            self.cost_model("none")  # measures T(k) once (shared by every cost model)
            self._bandit = DraftBandit(self._target_costs)
        return self._bandit

    @property
    def target_measured(self) -> bool:
        """Whether the target's T(k) is known (until then, building an auto-γ row measures it: the
        target's cache is reset)."""
        return self._target_costs is not None

    def uses_draft_model(self, draft: str) -> bool:
        """Whether generations with `draft` run the draft model (one sequence at a time: it has one cache)."""
        return draft == "model" or (draft == "auto" and self.draft_model is not None)

    def cost_model(self, draft: str, max_gamma: int = MAX_AUTO_GAMMA) -> CostModel:
        """The target's T(k) at a few context depths and T(B, k) (measured once, refined by every
        auto-gamma iteration: they are shared by every drafter's cost model) and the drafter's time per
        token and per proposal (measured once per drafter, then refined by its auto-gamma proposals; a
        copying drafter is priced per proposal)."""
        if isinstance(self.target, Seq2SeqLM) and (self._target_costs is None or draft not in self._costs):
            self.set_source(torch.randint(0, self.target.vocab_size, (64,),
                                          generator=torch.Generator().manual_seed(0)).tolist())
        if self._target_costs is None:
            depths, curves = target_costs(self.target, max_gamma + 1)
            self._target_costs = curves[0]
            self._target_observations = [0] * len(self._target_costs)
            self._depth_costs = DepthCosts(depths[0], depths[1:], curves[1:])
        if draft not in self._costs:
            drafter = self.make(draft)
            draft_s = 0.0 if drafter is None else measure_drafter(drafter, self.target.vocab_size,
                                                                  SamplingParams(temperature=1.0), k=MEASURED_DRAFT_K)
            self._costs[draft] = CostModel(self._target_costs, draft_s, target_observations=self._target_observations,
                                           extra_at=self._target_extra_at,
                                           batch=self._batch_costs, ragged=isinstance(self.target, RowContexts) and self.target.ragged,
                                           depth=self._depth_costs, copies=draft in COPYING,
                                           draft_s_per_step=MEASURED_DRAFT_K * draft_s)
        return self._costs[draft]

    def save_costs(self, min_iterations: int = MIN_REFINED) -> bool:
        """Persist T(k) as real iterations have refined it (`measure.save_refined`), once at least
        `min_iterations` more have been seen since the last save. -> whether it was written."""
        if self._target_costs is None:
            return False
        seen = sum(self._target_observations) + sum(map(sum, self._depth_costs.observations))
        if seen - self._saved_iterations < min_iterations:
            return False
        depths = [self._depth_costs.base, *self._depth_costs.depths]
        written = save_refined(self.target, depths, next(iter(self._costs.values())).curves())
        self._saved_iterations = seen
        return written

    def acceptance(self, draft: str) -> Acceptance:
        """What auto γ has learned about a drafter's acceptance (by match length), kept across requests."""
        if draft not in self._acceptance:
            self._acceptance[draft] = Acceptance(self.prior_alpha)
        return self._acceptance[draft]

    def probes(self, draft: str) -> Probes:
        """When auto γ next probes a drafter's written-off copies (`Probes`), kept across requests."""
        return self._probes.setdefault(draft, Probes())

    def view(self, draft: str, views: dict, cautious: bool = False) -> RequestAcceptance:
        """A request's view of a drafter's acceptance, kept in its `views` (`generation.Request.views`):
        made on first use, `cautious` for a batch's rows (RequestAcceptance)."""
        if draft not in views:
            views[draft] = RequestAcceptance(self.acceptance(draft), cautious=cautious)
        return views[draft]

    def policy(self, gamma: int | str, draft: str, views: dict | None = None) -> tuple[Drafter | None, int | AutoGamma]:
        """A fresh drafter and the γ policy for one generation: a fixed γ, or an AutoGamma over the cost
        model and learned acceptance for "auto" (γ = 0, or no drafter and no grammar, is plain decoding).
        `views` (a request's, `generation.Request.views`): the request's view of the acceptance, kept
        there per drafter, so that every generation of the request learns from the others' drafts."""
        if gamma == "auto" and draft != "none":
            view = self.view(draft, views if views is not None else {})
            gamma = AutoGamma(self.cost_model(draft), acceptance=view, probes=self.probes(draft))
        elif gamma == "auto":  # no drafter: the only drafts are grammar-forced ones, which γ does not budget
            gamma = 1
        return (self.make(draft, gamma) if gamma != 0 else None), gamma

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
