"""`--draft auto`: choose among the available drafters per iteration, by measured acceptance x cost.

The seed paper's point: the right draft depends on the target and the workload (prompt lookup wins
when the answer copies the prompt, an n-gram or a draft model when it does not). Two kinds of arm:

- Copying arms (prompt lookup over the request's own context; the store of earlier requests and
  running siblings, drafters/suffix.py) report a match length. Under auto γ each copy is priced
  BEFORE it is proposed: auto γ's learned acceptance for that source, sampling mode and match length
  (`Acceptance.of`) and the target's measured T(k) give the best cut's predicted speed-up, and the
  copy that pays most wins. A copy inside a long verbatim run is nearly certain; a one-token match
  in open chat nearly never is: one α for both, as a bandit over arms keeps, prices both wrong.
- Model arms (bigram, a draft model) have no match length: a small bandit ranks them (each keeps a
  Beta posterior over its per-token acceptance α and a measured cost per proposed token c; Thompson
  sampling scores max_γ E[tokens](α, γ) / step_cost(γ, c), Leviathan et al. Theorem 3.8 with the
  measured T(k)). They propose only when no copy is predicted to pay, at the γ auto γ gives them.

Under a fixed γ there is no price per copy: the bandit ranks every arm. What earlier requests taught
is kept per engine (`DraftBandit`, and the engine's `Acceptance`), shrunk to a bounded weight, and
each request adds its own outcomes on top. Exactness is untouched: whichever arm proposes, its
proposal and draft law go to the same verifier. At T > 0 a seed fixes the output only given what
the engine has learned (the choice of arm depends on it).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import torch

from ..speculative.interfaces import Copies, Drafter, Finishing, Lookups, PricesArms, Proposal
from ..speculative.params import sampling_mode
from ..speculative.sampling import SamplingParams
from ..speculative.theory import expected_tokens


@dataclass
class Arm:
    """What is known about one drafter: accepted drafts, rejections, seconds per proposed token."""

    successes: float = 0.0
    failures: float = 0.0
    draft_s_per_token: float | None = None  # measured from its proposals (EMA)
    chosen: int = 0  # proposals made

    def observe_cost(self, seconds_per_token: float) -> None:
        old = self.draft_s_per_token
        self.draft_s_per_token = seconds_per_token if old is None else old + 0.2 * (seconds_per_token - old)


@dataclass
class DraftBandit:
    """Per-engine knowledge of every drafter, kept across requests. `target_s`: the target's T(k),
    k = 1..K (the engine's cost model, shared and refined by auto-γ)."""

    target_s: list[float]
    prior: tuple[float, float] = (1.0, 1.0)  # Beta(successes, failures) before any outcome
    memory: float = 32.0  # earlier requests weigh at most this many outcomes
    arms: dict[str, Arm] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)

    def arm(self, name: str) -> Arm:
        return self.arms.setdefault(name, Arm())

    def score(self, alpha: float, draft_s_per_token: float, k: int) -> float:
        """Best predicted speed-up over γ = 1..k (Theorem 3.8 with measured costs)."""
        t1 = self.target_s[0]
        best = 0.0
        for gamma in range(1, min(k, len(self.target_s) - 1) + 1):
            cost = (gamma * draft_s_per_token + self.target_s[gamma]) / t1
            best = max(best, expected_tokens(alpha, gamma) / cost)
        return best

    def ranking(self, names: list[str], local: dict[str, Arm], k: int) -> list[str]:
        """Arms ordered best first by Thompson-sampled score: the engine's posterior (shrunk to at most
        `memory` outcomes) plus this request's own outcomes (`local`)."""
        scores = {}
        with self.lock:
            for name in names:
                glob, own = self.arm(name), local.setdefault(name, Arm())
                seen = glob.successes + glob.failures
                w = min(1.0, self.memory / seen) if seen else 1.0
                a = self.prior[0] + w * glob.successes + own.successes
                b = self.prior[1] + w * glob.failures + own.failures
                alpha = self.rng.betavariate(a, b)
                cost = own.draft_s_per_token if own.draft_s_per_token is not None else glob.draft_s_per_token
                scores[name] = self.score(alpha, cost or 0.0, k)
        return sorted(names, key=lambda n: -scores[n])


class AutoDrafter:
    """A `Drafter` that delegates each proposal to one of its arms. `name` is the arm that made the last
    proposal (what the decode loop records per drafter), `source` the kind auto γ prices it by.

    Under a fixed γ the bandit's first-ranked arm proposes. Under auto γ (`policy` set) the proposal
    is priced before it is made, per arm: every copying arm (the request's own context; the store of
    earlier requests and siblings) looks up its match, and the copy whose best cut auto γ predicts to
    pay most wins (α learned per source, sampling mode and match length: `Acceptance.of`). Only when
    no copy is predicted to pay do the model arms (bigram, a draft model) propose, ranked by the
    bandit, each at the width auto γ gives its own learned α, and only if that width pays. A copy
    that does not pay is still returned when no model arm does, so that auto γ's probes keep
    measuring it. The decode loop then cuts the proposal (`CutsCopies.choose`), as for any copy."""

    def __init__(self, bandit: DraftBandit, arms: dict[str, Drafter], policy: PricesArms | None = None) -> None:
        if not arms:
            raise ValueError("auto drafting needs at least one drafter")
        self.bandit, self.arms, self.policy = bandit, arms, policy
        self.local: dict[str, Arm] = {}
        self.name = "auto"
        self.source: str | None = None
        self.copies = policy is not None  # auto γ cuts the proposal afterwards (speculative/propose.py)
        self._last: str | None = None
        self._protocols: tuple[dict, dict, dict] | None = None  # `_as_protocols`, with the arms dict it read

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, law=None) -> Proposal:
        self._last = self.source = None
        if k <= 0:
            return Proposal.empty()
        if self.policy is not None:
            return self._priced(context, k, params, generator, law)
        for name in self.bandit.ranking(list(self.arms), self.local, k):
            proposal = self._from(name, context, k, params, generator, law)
            if len(proposal):
                copier = self._as_protocols()[0].get(name)  # a copy's source ("context" / "store"), else the name
                return self._chose(name, proposal, (copier.source if copier is not None else None) or name)
        return Proposal.empty()

    def _priced(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                law) -> Proposal:
        mode = sampling_mode(params)
        copiers, lookups = self._as_protocols()
        copies = []  # (predicted speed-up, arm, proposal, source)
        for name, arm in self.arms.items():
            if arm.copies:
                if name in lookups:  # no lookup for matches too short to pay
                    self.policy.set_shortest(lookups[name], [(s, mode) for s in lookups[name].sources])
                proposal = arm.propose(context, k, params, generator, law=law)  # timed by auto γ, per proposal
                if len(proposal):
                    source = (copiers[name].source if name in copiers else None) or "context"
                    gain = self.policy.best([(proposal.match, len(proposal), (source, mode))], 1)[1]
                    copies.append((gain, name, proposal, source))
        copies.sort(key=lambda c: -c[0])
        if copies and copies[0][0] >= self.policy.min_gain:
            return self._chose(*copies[0][1:])
        widths = {}  # model arm -> the width auto γ gives its learned α, where that width pays
        for name, arm in self.arms.items():
            if not arm.copies:
                width = self.policy.model_width((name, mode), k)
                if width:
                    widths[name] = width
        for name in self.bandit.ranking(list(widths), self.local, k) if len(widths) > 1 else widths:
            proposal = self._from(name, context, widths[name], params, generator, law)
            if len(proposal):
                return self._chose(name, proposal, name)
        return self._chose(*copies[0][1:]) if copies else Proposal.empty()

    def _as_protocols(self) -> tuple[dict[str, Copies], dict[str, Lookups]]:
        """The arms that are `Copies`, and those that are `Lookups`, by name: checked once per arms dict
        (`source.read_source` may replace it before decoding), not every iteration."""
        if self._protocols is None or self._protocols[2] is not self.arms:
            self._protocols = ({n: a for n, a in self.arms.items() if isinstance(a, Copies)},
                               {n: a for n, a in self.arms.items() if isinstance(a, Lookups)}, self.arms)
        return self._protocols[0], self._protocols[1]

    def _from(self, name: str, context: list[int], k: int, params: SamplingParams,
              generator: torch.Generator | None, law) -> Proposal:
        """Arm `name`'s proposal, its drafting time per token recorded (the bandit's cost)."""
        t = time.perf_counter()
        proposal = self.arms[name].propose(context, k, params, generator, law=law)
        if len(proposal):
            per_token = (time.perf_counter() - t) / len(proposal)
            self.local.setdefault(name, Arm()).observe_cost(per_token)
            with self.bandit.lock:
                self.bandit.arm(name).observe_cost(per_token)
        return proposal

    def _chose(self, name: str, proposal: Proposal, source: str) -> Proposal:
        with self.bandit.lock:
            self.bandit.arm(name).chosen += 1
        self._last = self.name = name
        self.source = source
        return proposal

    def finish(self, context: list[int]) -> None:
        """The generation ended: arms that keep something of it (the suffix drafter's store) are told."""
        for arm in self.arms.values():
            if isinstance(arm, Finishing):
                arm.finish(context)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        name = self._last
        if name is None or not num_proposed:
            return
        self.arms[name].observe(num_proposed, num_accepted)
        rejected = float(num_accepted < num_proposed)
        own = self.local.setdefault(name, Arm())
        own.successes += num_accepted
        own.failures += rejected
        with self.bandit.lock:
            arm = self.bandit.arm(name)
            arm.successes += num_accepted
            arm.failures += rejected
