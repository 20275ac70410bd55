"""Auto γ: the policy that chooses how many drafts each iteration verifies, from the prices of
`costs.py` and the acceptance of `acceptance.py`. The decode loop asks it through the protocols of
speculative/interfaces.py, never this class: `GammaPolicy` (a budget before drafting, and the outcomes
of every iteration), `CutsCopies` (a width after drafting: copies are cut once their match length is
known; batches rest while their copies do not pay), `SpacesLookups` (context-only copiers' lookups are
spaced) and `PricesArms` (the auto drafter's arms are priced before they propose)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..speculative.interfaces import Lookups
from ..speculative.theory import expected_tokens
from .acceptance import BUCKET_EDGES, Acceptance, RequestAcceptance
from .costs import CostModel


MAX_PROBE_GAP = 512  # the most plain steps between two probes (`Probes`): a written-off copy is retried so often
REPRICE = 16  # calls `AutoGamma.shortest_paying` answers from its last pricing (until an outcome)
MAX_REST = 8  # the longest a batch sits out drafting (AutoGamma.resting): a copy found late loses at most this
FOLD = 8  # one-row plain steps a policy times before it moves the shared T(1) by them (`AutoGamma.observe_step`)


@dataclass
class Probes:
    """When auto γ next verifies one draft that it does not expect to pay (a probe of γ = 1), so that an
    acceptance it has written off gets measured again: after `gap` plain steps, the gap doubling after each
    probe up to MAX_PROBE_GAP. An engine keeps one per drafter across its requests (`Learned.probes`):
    started over at 8 in every request, cold chat ran 17 probes in 768 steps, each a two-token pass at
    ~1.9x a step on a Zen 5, ~2% of the run, where a shared schedule runs 6."""

    gap: int = 8
    plain_steps: int = 0  # plain steps since the last probe

    def plain(self) -> bool:
        """One more plain step: whether a probe is due now (the gap then doubles)."""
        self.plain_steps += 1
        if self.plain_steps < self.gap:
            return False
        self.plain_steps, self.gap = 0, min(2 * self.gap, MAX_PROBE_GAP)
        return True

    @property
    def due(self) -> bool:
        """Whether the next plain step would be a probe."""
        return self.plain_steps + 1 >= self.gap

    def skipped(self) -> None:
        """A plain step with no lookup (`lookups.next_lookup`): it counts towards the next probe, which
        then waits for a step that looks up."""
        self.plain_steps = min(self.plain_steps + 1, self.gap - 1)


class AutoGamma:
    """Chooses γ for every iteration from the cost model and what the engine has learned about the drafter.

    Model drafters (no match information): γ is chosen before drafting from one α (the paper's model).
    Copying drafters (prompt lookup): the drafter proposes up to `max_gamma` tokens and reports its
    match length; `choose` then keeps the prefix with the best E[tokens | match] / cost (see the module
    docstring). In a batch, one width serves all rows (the forward is padded to it) and the iteration is
    priced by T(B, width + 1) against batched plain T(B, 1): as the batch fills, γ shrinks, then stops.
    While the best γ is 0 the loop decodes plainly and probes with γ=1 now and then, with the gap
    doubling after each probe that still says "don't speculate" (`Probes`, shared by an engine's
    requests), so a losing drafter costs a vanishing fraction of the steps. Speculation must be predicted
    to win by `min_gain` before it is used: measured costs are noisy and the per-iteration bookkeeping
    (warping γ+1 rows, verifying) is not in T(k).
    A row is priced at its context depth (`depth`: the decode loop sets it to len(row.context) before it
    drafts; every method's `depth` defaults to it, None: the base measurement's).
    """

    def __init__(self, cost: CostModel, prior_alpha: float = 0.3, prior_strength: float = 4.0,
                 first_probe: int = 8, min_gain: float = 1.05, acceptance: Acceptance | RequestAcceptance | None = None,
                 probes: Probes | None = None):
        self.cost, self.min_gain = cost, min_gain
        self.max_gamma, self.ragged = cost.max_gamma, cost.ragged  # the cost model's: fixed for its life
        self.acceptance = acceptance if acceptance is not None else Acceptance(prior_alpha, prior_strength)
        self.probes = probes if probes is not None else Probes(first_probe)
        self.rest, self.rest_gap = 0, 1  # batched iterations left to sit out, and the next rest (`resting`)
        self.depth: int | None = None  # the context depth of the row being priced (set by propose.py)
        self._prices: tuple | None = None  # (key, step costs, their floors): `_step_costs`
        self._priced: dict[tuple, tuple[int, int]] = {}  # `_recall`: (an answer, calls it still serves)
        self._wide: tuple[int, float, int | None] | None = None  # a one-row wide pass: observed with the next step
        self._plain: list[tuple[float, int | None]] = []  # one-row plain steps (seconds, depth) not yet observed

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha(None)

    def budget(self, rows: int, copying: bool) -> int:
        """Drafts to propose this iteration in a batch of `rows`: a copying drafter all auto may use
        (cut afterwards by `choose`, once the match length is known), a model drafter `next_gamma`."""
        return self.max_gamma if copying else self.next_gamma(rows)

    def skip_lookup(self) -> bool:
        """A context-only copier's lookup that no match can make pay yet (`lookups.next_lookup`) is
        skipped, and counts towards the next probe; not while a probe is due."""
        if self.probes.due:
            return False
        self.probes.skipped()
        return True

    def ragged_widths(self, alphas: list[tuple[float, int]], base: list[int],
                      left: list[int] | None = None) -> list[int]:
        """A ragged batch's drafts per row (module `ragged_widths`, at this policy's min_gain)."""
        self.fold()
        return ragged_widths(self.cost, alphas, base, self.min_gain, left)

    def next_gamma(self, batch: int = 1, depth: int | None = None) -> int:
        """γ before drafting (model drafters: every row expects the same)."""
        return self.choose([(None, self.max_gamma)], batch, depth)

    def speedup(self, rows: list[tuple], gamma: int, batch: int | None = None, depth: int | None = None) -> float:
        """Predicted speed-up of one iteration of width γ over plain decoding, for rows of (match
        length, tokens available to propose[, kind: see Acceptance.of]) in a batch of `batch` rows
        (default: these rows)."""
        self.fold()
        tokens = sum(expected_tokens(self.acceptance.of(kind).alpha(m), min(gamma, avail)) for m, avail, kind in _kinds(rows))
        return tokens / len(rows) / self.cost.step_cost(gamma, batch or len(rows), self._depth(depth))

    def _depth(self, depth: int | None) -> int | None:
        return self.depth if depth is None else depth

    def _step_costs(self, batch: int, depth: int | None) -> tuple[list[float], list[float]]:
        """`step_cost(γ)` for γ = 0..max_gamma, and floor[γ] = the least of them from γ on: found once
        per iteration (every copy, model arm and cut of a step is priced against them; a width's cost
        does not depend on the widest priced)."""
        self.fold()
        key = (batch, depth, self.cost.version)
        if self._prices is None or self._prices[0] != key:
            costs = self.cost.step_costs(self.max_gamma, batch, depth)
            floor = list(costs)
            for g in range(len(floor) - 2, -1, -1):
                floor[g] = min(floor[g], floor[g + 1])
            self._prices = (key, costs, floor)
        return self._prices[1], self._prices[2]

    def best(self, rows: list[tuple], batch: int | None = None, depth: int | None = None) -> tuple[int, float]:
        """-> (the width γ with the highest predicted speed-up for `rows`, that speed-up); no side
        effects (`choose` adds the gain threshold and the probes)."""
        widest = min(max((row[1] for row in rows), default=0), self.max_gamma)
        alphas = [(self.acceptance.of(kind).alpha(m), avail) for m, avail, kind in _kinds(rows)]
        batch, depth = batch or len(rows), self._depth(depth)
        best, gain = 0, 0.0
        costs, floor = self._step_costs(batch, depth)
        if len(alphas) == 1:  # one row: every proposal is priced so
            return _one_row(alphas[0][0], widest, costs, floor)
        for g in range(widest + 1):  # the same arithmetic as `speedup`, each row's α looked up once
            tokens = sum(expected_tokens(alpha, min(g, avail)) for alpha, avail in alphas)
            value = tokens / len(rows) / costs[g]
            if value > gain:  # ties: the smaller γ
                best, gain = g, value
        return best, gain

    def shortest_paying(self, kinds: list[object], longest: int = 3) -> int:
        """The shortest match length (at most `longest`) at which a copy of one of `kinds` is predicted
        to pay at some width (`best`), so that a lookup need not look for shorter ones; every length
        while a probe is due (`choose`), so that a short match that has started to pay is found. Priced
        again after every outcome (`observe`) and every REPRICE calls (costs drift slowly). A match's α is
        its bucket's, so only the buckets' shortest lengths are priced."""
        if self.probes.due:
            return 1
        key = ("copy", tuple(kinds), longest)
        known = self._recall(key)
        if known is not None:
            return known
        costs, floor = self._step_costs(1, self.depth)  # `best` of one row at every width, inline
        views = [self.acceptance.of(kind) for kind in kinds]
        for match in BUCKET_EDGES:
            if match >= longest:
                break
            if any(_one_row(view.alpha(match), self.max_gamma, costs, floor)[1] >= self.min_gain for view in views):
                return self._keep(key, match)
        return self._keep(key, longest)

    def set_shortest(self, drafter: Lookups, kinds: list[object], longest: int = 3) -> None:
        """Tell a copier the shortest match worth its lookup (`shortest_paying`): shorter ones are not
        looked for. The one place a drafter's lookup settings change (a row's lookups, speculative/lookups.py,
        and the auto drafter's arms)."""
        drafter.shortest = self.shortest_paying(kinds, longest)

    def model_width(self, kind: object, k: int) -> int:
        """The width auto γ gives a model drafter's proposal of at most k tokens (`best` at its one α,
        `kind`), 0 where no width pays by min_gain: priced, as `shortest_paying` is, again after every
        outcome and every REPRICE calls (the auto drafter asks every step whether a model arm pays)."""
        def price(widest: int) -> int:
            width, gain = self.best([(None, widest, kind)], 1)
            return width if gain >= self.min_gain else 0
        key = ("model", kind)
        width = self._recall(key)
        if width is None:
            width = self._keep(key, price(self.max_gamma))
        return width if width <= k else price(k)  # no width pays at k that does not at max_gamma

    def _recall(self, key: tuple) -> int | None:
        """The answer priced for `key`, while it is kept (REPRICE calls, or until the next outcome:
        `observe`); None: price it again (`_keep`)."""
        known = self._priced.get(key)
        if known is None or known[1] <= 0:
            return None
        self._priced[key] = (known[0], known[1] - 1)
        return known[0]

    def _keep(self, key: tuple, answer: int) -> int:
        """A new pricing's answer for `key`: it serves this call and the REPRICE after it."""
        self._priced[key] = (answer, REPRICE)
        return answer

    def alphas(self, rows: list[tuple]) -> list[tuple[float, int]]:
        """(α, drafts it may keep) per row of (match length, proposal length[, kind])."""
        return [(self.acceptance.of(kind).alpha(m), min(avail, self.max_gamma)) for m, avail, kind in _kinds(rows)]

    def choose(self, rows: list[tuple[int | None, int]], batch: int | None = None, depth: int | None = None) -> int:
        """The width γ (0 = plain) for one iteration; `rows`: (match length, proposal length[, kind])
        per row, in a batch of `batch` rows (default: these rows), at a context of `depth` tokens."""
        if min(max((row[1] for row in rows), default=0), self.max_gamma) <= 0:
            return 0
        gamma, gain = self.best(rows, batch, depth)
        if gamma > 0 and gain >= self.min_gain:
            return gamma
        return 1 if self.probes.plain() else 0

    def resting(self) -> bool:
        """Whether a batch's copying rows skip drafting this iteration (one call per iteration). After an
        iteration whose copies were all cut to nothing (`batch_drafted(False)`), the batch sits out as
        many iterations as the gap, which doubles up to MAX_REST while copies keep not paying: drafting a
        batch costs every row's lookups and pricing (5-11% of a batched chat iteration here, where no
        copy paid), and a batch's extra pass is dearer than a lone row's."""
        if self.rest > 0:
            self.rest -= 1
            return True
        return False

    def batch_drafted(self, drafted: bool) -> None:
        """A batch iteration's outcome: some row drafted (the gap starts over) or none did (rest)."""
        if drafted:
            self.rest_gap = 1
        else:
            self.rest, self.rest_gap = self.rest_gap, min(2 * self.rest_gap, MAX_REST)

    def observe_step(self, k: int, seconds: float, batch: int = 1, lengths: list[int] | None = None,
                     depth: int | None = None) -> None:
        """One iteration over up to k new tokens per row (the last context token and k-1 drafts; row b's
        count in `lengths`) took `seconds`, at a context of `depth` tokens (default: `self.depth`).

        A one-row wide pass is charged what the one-token step after it takes beyond T(1), too: llama.cpp
        builds a new graph for every change of pass shape, and that step runs well above the steps after
        steps (measured in docs/drafters.md). Timed alone,
        the wide passes left that cost to T(1), where no choice of γ saw it, and drafts that saved a
        little less than they cost were still made. So a wide pass is observed with the step after it
        (that step then moves T(1) only down: the rest of it is the wide pass's).

        A one-row plain step (most steps, and every step of a short answer) is kept, and moves T(1) with
        the others `fold` takes in: before this policy next prices, every FOLD of them, and when a row of
        it ends (`finish`). Observed one by one, each moved every width of the shared curves right after
        a pass, where Python runs slower than warm (measured in docs/drafters.md); other requests'
        policies and the auto drafter see them up to FOLD steps late."""
        if k == 1 and batch == 1 and self._wide is None:
            self._plain.append((seconds, self._depth(depth)))
            if len(self._plain) >= FOLD:
                self.fold()
            return
        self.fold()
        depth = self._depth(depth)
        wide, self._wide = self._wide, None
        if wide is not None:
            wide_k, wide_s, wide_depth = wide
            if k == 1 and batch == 1:
                after = seconds - self.cost.target_seconds(1, depth)  # the change of shape, and noise
                wide_s, seconds = wide_s + max(after, 0.0), seconds - max(after, 0.0)
            self.cost.observe_target(wide_k, wide_s, 1, None, wide_depth)
        if k > 1 and batch == 1:
            self._wide = (k, seconds, depth)  # observed with the next step
            return
        self.cost.observe_target(k, seconds, batch, lengths, depth)

    def fold(self) -> None:
        """Move the shared T(1) by the one-row plain steps kept since the last fold (`observe_step`), in
        the order they ran."""
        if self._plain:
            plain, self._plain = self._plain, []
            self.cost.observe_plain(plain)

    def finish(self) -> None:
        """A row of this policy ended: what it timed goes into the shared costs now."""
        self.fold()

    def observe(self, proposed: int, accepted: int, draft_s: float | None = None, match: int | None = None,
                kind: object = None) -> None:
        """Outcome of one proposal (of `kind`, see Acceptance.of); `draft_s` (its drafting time) refines
        the drafter's measured cost, which a one-off measurement on a busy machine can get badly wrong."""
        if proposed:
            self._priced.clear()
            self.acceptance.of(kind).observe(proposed, accepted, match)
            if draft_s is not None:
                self.cost.observe_draft(draft_s / proposed, draft_s)


def _one_row(alpha: float, widest: int, costs: list[float], floor: list[float]) -> tuple[int, float]:
    """`AutoGamma.best` for one row of acceptance α: `expected_tokens` inline, and the scan stopped where
    no wider width can beat the best so far (E[tokens] < 1/(1 - α); floor[g]: the least cost from g on)."""
    best, gain = 0, 0.0
    most = widest + 1.0 if alpha == 1.0 else 1.0 / (1.0 - alpha)
    for g in range(widest + 1):
        if most / floor[g] <= gain:
            break
        value = (g + 1.0 if alpha == 1.0 else (1.0 - alpha ** (g + 1)) / (1.0 - alpha)) / costs[g]
        if value > gain:
            best, gain = g, value
    return best, gain


def best_ragged(cost: CostModel, alphas: list[tuple[float, int]], base: list[int],
                left: list[int] | None = None) -> tuple[list[int], float]:
    """A ragged target's batch, its rows in cache order: row b scores base[b] tokens anyway and may add up
    to alphas[b][1] drafts, each accepted with alphas[b][0] -> (drafts per row, the predicted speed-up over
    scoring `base`). Drafts are added one at a time, each to the row whose next draft is likeliest
    accepted (its g-th: α^g more tokens expected), and the count with the best value / cost is kept.

    What a row's extra tokens are worth depends on who waits for them. `left` None (a server: each
    request waits for its own row): the batch's plain iteration per row, as a lone request's tokens are
    worth its T(1). `left` (tokens each row may still emit, in a batch that ends with its last row and
    has no request waiting for a row's place): what they save the batch (`batch_value`)."""
    memo: dict[tuple[int, int], float] = {}  # pass shape -> its price, for every candidate below
    plain, batch = cost.ragged_seconds(base, memo), len(base)
    value = (lambda tokens: sum(tokens) / batch) if left is None else batch_value(cost, left)
    tokens = [1.0] * batch  # expected out per row
    widths, best, gain, unit = [0] * batch, [0] * batch, 1.0, value(tokens)
    lengths, drafting = list(base), 0.0
    queue = [(-alpha, b) for b, (alpha, avail) in enumerate(alphas) if avail > 0]
    heapq.heapify(queue)
    while queue and -queue[0][0] >= 0.01:
        more, b = heapq.heappop(queue)
        drafting += cost.draft_seconds(widths[b] + 1) - cost.draft_seconds(widths[b])
        widths[b], tokens[b], lengths[b] = widths[b] + 1, tokens[b] - more, lengths[b] + 1
        seconds = cost.ragged_seconds(lengths, memo) + drafting
        ratio = value(tokens) / unit / (seconds / plain)
        if ratio > gain:
            best, gain = list(widths), ratio
        alpha, avail = alphas[b]
        if widths[b] < avail:
            heapq.heappush(queue, (more * alpha, b))
    return best, gain


def batch_value(cost: CostModel, left: list[int]):
    """What a batch that ends with its last row saves when row b emits tokens[b] (expected) this
    iteration, in seconds of plain iterations to come: a plain iteration of n rows costs about
    fixed + n * per_row (from T(1) and batched plain T(B)), so a row's token saves its per_row share of
    the passes it no longer joins, and only what its LAST row gains (here: the least of the rows with
    the most left) shortens the batch by whole passes. A copy in one row of eight whose answers all run
    to their budget saves ~per_row a token, not a pass."""
    single, together = cost.seconds(1), cost.seconds(1, batch=len(left))
    per_row = min(max((together - single) / max(len(left) - 1, 1), 0.0), single)
    fixed, longest = single - per_row, max(left)
    last = [b for b, n in enumerate(left) if n == longest]

    def value(tokens: list[float]) -> float:
        return (fixed * min(min(tokens[b] for b in last), longest)
                + per_row * sum(min(t, n) for t, n in zip(tokens, left)))
    return value


def ragged_widths(cost: CostModel, alphas: list[tuple[float, int]], base: list[int], min_gain: float,
                  left: list[int] | None = None) -> list[int]:
    """`best_ragged`'s drafts where they are predicted to win by `min_gain`, else none. No probes (as
    `AutoGamma.choose` makes): here a probe costs a pass of its own (~T(1)), and what it would learn is
    learnt by the rows that do speculate."""
    widths, gain = best_ragged(cost, alphas, base, left)
    return widths if any(widths) and gain >= min_gain else [0] * len(base)


def _kinds(rows: list[tuple]) -> list[tuple]:
    """(match, available[, kind]) rows as (match, available, kind)."""
    return [(row[0], row[1], row[2] if len(row) > 2 else None) for row in rows]
