"""What an engine's auto γ learns across requests: the target's T(k) (by context depth) and T(B, k), each
drafter's cost model, acceptance and probe schedule, T(k) saved as real iterations refine it, and each
request's view of the acceptance. One `Learned` per engine (`drafting.Drafting.learned`); every auto-γ
generation gets a fresh `AutoGamma` over it (`policy`)."""

from __future__ import annotations

from collections.abc import Callable

from ..speculative.interfaces import CausalLM, Drafter, RowContexts
from ..speculative.params import SamplingParams
from .acceptance import Acceptance, RequestAcceptance
from .costs import MAX_AUTO_GAMMA, BatchCosts, CostModel, DepthCosts
from .measure import measure_drafter, save_refined, target_costs
from .policy import AutoGamma, Probes

COPYING = ("prompt-lookup", "suffix", "store", "auto")  # drafters auto γ cuts after a lookup: priced per proposal
MEASURED_DRAFT_K = 4  # the proposal length `measure_drafter` times
MIN_REFINED = 32  # iterations that refined T(k) before it is worth persisting (`Learned.save_costs`)


class Learned:
    """The state auto γ keeps for one target across requests, per drafter by name."""

    def __init__(self, target: CausalLM, prior_alpha: float = 0.3):
        self.target = target
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

    @property
    def target_measured(self) -> bool:
        """Whether the target's T(k) is known (until then, pricing a drafter measures it: the target's
        cache is reset)."""
        return self._target_costs is not None

    @property
    def target_s(self) -> list[float] | None:
        """The target's T(k), k = 1..K (refined in place by every cost model), or None before it is measured."""
        return self._target_costs

    def priced(self, draft: str) -> bool:
        """Whether `draft` has its cost model (and so the target its T(k)): `cost_model` measures nothing."""
        return self._target_costs is not None and draft in self._costs

    def cost_model(self, draft: str, make: Callable[[str], Drafter | None],
                   max_gamma: int = MAX_AUTO_GAMMA) -> CostModel:
        """The target's T(k) at a few context depths and T(B, k) (measured once, refined by every
        auto-gamma iteration: they are shared by every drafter's cost model) and the drafter's time per
        token and per proposal (measured once per drafter, on a fresh one from `make`, then refined by its
        auto-gamma proposals; a copying drafter is priced per proposal)."""
        if self._target_costs is None:
            depths, curves = target_costs(self.target, max_gamma + 1)
            self._target_costs = curves[0]
            self._target_observations = [0] * len(self._target_costs)
            self._depth_costs = DepthCosts(depths[0], depths[1:], curves[1:])
        if draft not in self._costs:
            drafter = make(draft)
            draft_s = 0.0 if drafter is None else measure_drafter(drafter, self.target.vocab_size,
                                                                  SamplingParams(temperature=1.0), k=MEASURED_DRAFT_K)
            ragged = isinstance(self.target, RowContexts) and self.target.ragged
            self._costs[draft] = CostModel(self._target_costs, draft_s, target_observations=self._target_observations,
                                           extra_at=self._target_extra_at, batch=self._batch_costs, ragged=ragged,
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

    def policy(self, draft: str, cost: CostModel, views: dict | None = None) -> AutoGamma:
        """A fresh AutoGamma for one generation with `draft`, over its cost model and learned acceptance:
        `views` (a request's, `generation.Request.views`) keeps the request's view of it per drafter, so
        that every generation of the request learns from the others' drafts."""
        view = self.view(draft, views if views is not None else {})
        return AutoGamma(cost, acceptance=view, probes=self.probes(draft))
