"""A cost model that knows verification is not free, and the γ policy built on it.

Theorem 3.8 assumes scoring γ+1 tokens costs one target step. On CPUs (and for small models) it
does not: T(k), the time of one target forward over k new tokens, grows with k. The predicted
speed-up for acceptance rate α is

    E[tokens per iteration] / ((γ · t_draft + T(γ+1)) / T(1)),

which is Theorem 3.8 when T is flat and t_draft = c · T(1). A batch of B rows is priced the same way
by T(B, k), the time of one batched forward over B rows of k tokens, against batched plain T(B, 1).
A `ragged` target (batched llama.cpp) scores each row's own tokens, unpadded, and each row gets its own
γ. Such a target runs an iteration as passes over the model (`passes`: a run of adjacent rows with the
same number of tokens left shares one; llama.cpp splits a batch over per-row KV streams so): rows at
one token each are one pass, batched plain T(B, B); a row that also scores 4 drafts adds a one-row
pass, T(4). A pass of r rows x k tokens is priced T(r, r) + (T(r·k) − T(r)) (its plain step, plus the
extra tokens at the single-row curve's price), and what an iteration costs beyond batched plain is
scaled by a learned factor. Drafts go, one at a time, to the row whose next draft is likeliest
accepted (α^g for its g-th), and the count with the best E[tokens] / cost wins: one row inside a long
copy speculates while the rows beside it score one token each.

Where the paper's i.i.d. model holds, and where it does not. E[tokens] = (1 - α^(γ+1)) / (1 - α)
assumes every draft is accepted with the same probability α, independently of the others: a fair
model of a draft MODEL's proposals (model drafters keep it: one α, bucket 0 below). Prompt lookup
breaks it: its proposals are copies of earlier text, and whether the next copied token is right
depends on how long the copy has been right so far — inside a long copy (an edit's untouched lines)
runs of tens of tokens are accepted whole, right after an edit point or on a one-token match almost
nothing is. One global α averages those regimes, so it is too low to dare a 32-token proposal inside
a copy and too high to stay out of a fresh one. What replaces it: α conditioned on the proposal's
MATCH LENGTH (how many context tokens before the proposal agree with the text it copies: the
drafter reports it), in buckets 1, 2, 3-4, 5-8, 9-16, 17-32, 33+, each a Beta posterior updated
with exponential forgetting (recent proposals weigh most). Within a bucket the per-token model is
the paper's again, so the policy chooses, per proposal, the γ with the best E[tokens | match] /
cost, over the T(k) measured up to the largest γ it may use (32). The buckets' priors rise with
the match length, so a first request speculates on the copies it finds at once instead of decoding
plainly until a global α is convinced (which a short answer never outlives); what the engine learns
(bucket posteriors, T(k), T(B, k)) lives on the Engine and carries across requests.

Depth. Every pass attends over the whole context, so T(k) at a 3000-token agent prompt is not T(k) at
100 tokens, and the ratios T(k)/T(1) that decide γ move with it. T(k) is measured at two or three
context depths (`TARGET_DEPTHS`, capped by the target's context: `deeper_depths`), a row is
priced at its own depth (len(context)) by linear interpolation between the measured depths (beyond the
deepest: linear in depth, as attention is, between flat and proportional), and each real one-row
iteration refines the measured depths around the one it ran at, each by its share of the
interpolation (`DepthCosts`). Batched iterations are priced depth-free (T(B, k), as observed).
What the drafter itself costs is priced as measured per iteration: a copying drafter (prompt lookup,
the suffix store: it looks up one copy and is cut afterwards, `copies`) by its seconds per proposal,
whatever γ is kept; a model drafter by its seconds per drafted token. A drafter slower than the
tokens its drafts save gets γ = 0.
"""

from __future__ import annotations

import heapq
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..device import device_of, synchronize
from .interfaces import CausalLM
from .theory import expected_tokens


TARGET_WEIGHT = 0.2  # how far one real iteration moves T(k)
MAX_AUTO_GAMMA = 32  # the longest proposal auto may choose: T(k) is measured up to k = 33
MEASURED_K = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33)  # T(k) is measured at these k, interpolated between
TARGET_DEPTHS = (100, 1000, 3000)  # context depths T(k) is measured at (capped by the target's context)
DEEP_K = (1, 2, 4, 8, 16, 33)  # the k measured at the deeper depths (fewer: they cost more)
DEEP_REPS = 3  # repetitions at the deeper depths
DEEP_PREFILL_S = 20.0  # at most this long prefilling the deeper depths (then the depth reached is the last)
DEEP_PREFILL_CHUNK = 256  # tokens per prefill forward on the way down
CHANGE_CAP = 0.25  # the most a change of pass shape is charged, as a share of T(1) (~0.1 measured: `_measure_at`)


@dataclass
class DepthCosts:
    """T(k) at contexts deeper than the one `CostModel.target_s` was measured at (`base` tokens), and how
    many real iterations refined each (as `target_observations`). Shared by every drafter's cost model,
    like `target_s`. No depths: depth is not priced (every row costs `target_s`)."""

    base: int = 0  # the depth target_s was measured at
    depths: list[int] = field(default_factory=list)  # ascending, each > base
    seconds: list[list[float]] = field(default_factory=list)  # [D][K]: T(k) at depths[d]
    observations: list[list[int]] = field(default_factory=list)  # [D][K]

    def __post_init__(self) -> None:
        if len(self.observations) != len(self.seconds):
            self.observations = [[0] * len(row) for row in self.seconds]


@dataclass
class BatchCosts:
    """T(B, k) for batches of B > 1 rows. An (B, k) seen in real batched iterations is priced by its
    running average; an unseen one by the single-row T(B·k) (a CPU forward's cost follows the rows it
    multiplies), times how far the batched iterations seen so far were from that guess."""

    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    observations: dict[tuple[int, int], int] = field(default_factory=dict)
    scale: float = 1.0  # observed / guessed, averaged over batched iterations
    # ragged targets (see the module docstring)
    plain: dict[int, float] = field(default_factory=dict)  # T(B, B), B > 1: batched plain, observed
    extra: float = 1.0  # what iterations cost beyond batched plain, observed / priced


def passes(lengths: list[int]) -> list[tuple[int, int]]:
    """The passes over the model of one unpadded iteration whose row b scores lengths[b] tokens, as
    (rows, tokens per row): llama.cpp's split of a batch over one KV stream per row (llama_batch_allocr::
    split_equal, sequential) takes the first row with tokens left and the adjacent rows after it that
    have tokens left, and as many tokens from each as the shortest of them has."""
    left, out = list(lengths), []
    while True:
        start = next((b for b, n in enumerate(left) if n > 0), None)
        if start is None:
            return out
        end = start
        while end + 1 < len(left) and left[end + 1] > 0:
            end += 1
        k = min(left[start:end + 1])
        out.append((end - start + 1, k))
        for b in range(start, end + 1):
            left[b] -= k


@dataclass
class CostModel:
    target_s: list[float]  # [K]: seconds of one iteration over k = 1..K new tokens: measured, then refined
    draft_s_per_token: float = 0.0  # seconds the drafter spends per proposed token
    draft_observations: int = 0  # proposals that refined draft_s_per_token
    target_observations: list[int] = field(default_factory=list)  # [K]: real iterations that refined T(k)
    frozen: bool = False  # never refined: γ choices that do not depend on timing (tests)
    batch: BatchCosts = field(default_factory=BatchCosts)  # T(B, k), B > 1 (shared like target_s)
    ragged: bool = False  # the target scores rows unpadded: a batched iteration costs the passes it runs (above)
    depth: DepthCosts = field(default_factory=DepthCosts)  # T(k) at deeper contexts (shared like target_s)
    copies: bool = False  # a copying drafter: its time is priced per proposal (draft_s_per_step), not per token
    draft_s_per_step: float = 0.0  # seconds the drafter spends per proposal (whatever its length)
    draft_step_observations: int = 0
    version: int = 0  # observations so far (what AutoGamma's per-iteration price list is keyed by)

    def __post_init__(self) -> None:
        if not self.target_observations:
            self.target_observations = [0] * len(self.target_s)

    def _curves(self) -> list[tuple[int, list[float], list[int]]]:
        """(depth, T(k) there, its observation counts), shallowest first."""
        d = self.depth
        return [(d.base, self.target_s, self.target_observations), *zip(d.depths, d.seconds, d.observations)]

    def _span(self, depth: int | None) -> tuple[int, float]:
        """-> (i, w): T(k) at `depth` is (1 - w) · curve i + w · curve i+1 (w = 0: curve i alone; w > 1:
        extrapolated past the deepest)."""
        depths = [self.depth.base, *self.depth.depths]
        if depth is None or len(depths) == 1 or depth <= depths[0]:
            return 0, 0.0
        i = next((j for j in range(len(depths) - 1) if depth <= depths[j + 1]), len(depths) - 2)
        return i, (depth - depths[i]) / (depths[i + 1] - depths[i])

    def target_seconds(self, k: int, depth: int | None = None) -> float:
        """T(k) for one row at a context of `depth` tokens (None: the base measurement's): interpolated
        linearly between the measured depths; past the deepest, linear in depth (at least flat, at most
        proportional to the depth: attention's share can only grow)."""
        return self._interpolated(depth, k - 1, k)[0]  # k alone: every iteration asks it

    def target_curve(self, n: int, depth: int | None = None) -> list[float]:
        """[T(1), ..., T(n)] at `depth`, each as `target_seconds` gives it: the depth's place among the
        measured curves found once for all n (auto γ prices every width before every proposal)."""
        return self._interpolated(depth, 0, n)

    def _interpolated(self, depth: int | None, start: int, stop: int) -> list[float]:
        """[T(start + 1), ..., T(stop)] at `depth` (`target_seconds`)."""
        i, w = self._span(depth)
        if w == 0.0:
            return self.target_s[start:stop]
        curves = self._curves()
        lo, hi = curves[i][1][start:stop], curves[i + 1][1][start:stop]
        out = [(1.0 - w) * a + w * b for a, b in zip(lo, hi)]
        if w > 1.0:
            deepest = curves[i + 1][0]
            out = [min(max(t, b), b * depth / deepest) for t, b in zip(out, hi)]
        return out

    @property
    def max_gamma(self) -> int:
        return len(self.target_s) - 1

    def observe_draft(self, seconds_per_token: float, seconds: float | None = None) -> None:
        """Refine the drafter's cost from real proposals (per drafted token; `seconds`: the whole
        proposal's): the first replaces the one-off measurement, later ones move it by 20%."""
        if self.frozen:
            return
        self.version += 1
        weight = 1.0 if self.draft_observations == 0 else 0.2
        self.draft_s_per_token += weight * (seconds_per_token - self.draft_s_per_token)
        self.draft_observations += 1
        if seconds is not None:
            weight = 1.0 if self.draft_step_observations == 0 else 0.2
            self.draft_s_per_step += weight * (seconds - self.draft_s_per_step)
            self.draft_step_observations += 1

    def draft_seconds(self, gamma: int, batch: int = 1) -> float:
        """What drafting γ tokens in each of `batch` rows costs: a copying drafter's lookups (one per row,
        whatever γ is kept), or a model drafter's γ tokens per row."""
        if gamma <= 0:
            return 0.0
        return batch * (self.draft_s_per_step if self.copies else gamma * self.draft_s_per_token)

    def observe_target(self, k: int, seconds: float, batch: int = 1, lengths: list[int] | None = None,
                       depth: int | None = None) -> None:
        """Refine T(k) (or T(batch, k)) from one real iteration over k new tokens per row (forward +
        verification, timed by the decode loop). `measure_target` runs at one context length without the
        loop's bookkeeping; real decoding differs: on llama.cpp, attention over a 500-token grounded
        prompt took T(2)/T(1) to ~1.4 and T(3)/T(1) to ~1.9 where the measurement said 1.3 and 1.65.
        Each observation (clipped to [0.5, 2]x, against outliers) moves T(k) by TARGET_WEIGHT; a k never
        observed keeps its measured ratio to T(1). On a ragged target a batched iteration is priced by
        its rows' `lengths` (new tokens per row; default k each). A one-row iteration at `depth` moves
        the measured depths around it, each by its share of the interpolation (`target_seconds`): at a
        measured depth (or None: the base), that depth's T(k) alone, by TARGET_WEIGHT."""
        if self.frozen or not 1 <= k <= len(self.target_s):
            return
        self.version += 1
        if batch > 1 and self.ragged:
            return self._observe_ragged(lengths or [k] * batch, seconds)
        if batch > 1:
            return self._observe_batch(batch, k, seconds)
        ratio = min(max(seconds / self.target_seconds(k, depth), 0.5), 2.0)  # observed / predicted
        i, w = self._span(depth)
        curves = self._curves()
        for j, share in ((i, 1.0 - min(w, 1.0)), (i + 1, min(w, 1.0))):
            if share <= 0.0:
                continue
            _, curve, seen = curves[j]
            old = curve[k - 1]
            curve[k - 1] = old * (1.0 + TARGET_WEIGHT * share * (ratio - 1.0))
            seen[k - 1] += share >= 0.5
            if k == 1:  # a k never observed at this depth keeps its measured ratio to T(1) (in place: shared)
                scale = curve[0] / old
                curve[1:] = [t if s else t * scale for t, s in zip(curve[1:], seen[1:])]

    def _observe_batch(self, batch: int, k: int, seconds: float) -> None:
        costs, key = self.batch, (batch, k)
        guess = self.single_row_guess(batch, k)
        costs.scale += TARGET_WEIGHT * (min(max(seconds / guess, 0.25), 4.0) - costs.scale)
        seen = costs.observations.get(key, 0)
        old = costs.seconds.get(key, seconds)
        costs.seconds[key] = old + (1.0 if not seen else TARGET_WEIGHT) * (min(max(seconds, 0.5 * old), 2.0 * old) - old)
        costs.observations[key] = seen + 1

    def _observe_ragged(self, lengths: list[int], seconds: float) -> None:
        costs, batch = self.batch, len(lengths)
        if max(lengths) == 1:  # batched plain: T(B, B), and how far it is from the single-row T(B)
            old = costs.plain.get(batch, seconds)
            costs.plain[batch] = old + TARGET_WEIGHT * (min(max(seconds, 0.5 * old), 2.0 * old) - old)
            costs.scale += TARGET_WEIGHT * (min(max(seconds / self.single_row_guess(batch, 1), 0.25), 4.0) - costs.scale)
            return
        plain = self._plain(batch)
        priced = sum(self._pass_seconds(rows, k) for rows, k in passes(lengths)) - plain
        if priced > 0:
            observed = (seconds - plain) / priced
            costs.extra += TARGET_WEIGHT * (min(max(observed, 0.25), 4.0) - costs.extra)

    def single_row_guess(self, batch: int, k: int) -> float:
        """T(1, B·k), extrapolated linearly past the measured k."""
        rows, K = batch * k, len(self.target_s)
        if rows <= K:
            return self.target_s[rows - 1]
        slope = max((self.target_s[-1] - self.target_s[0]) / max(K - 1, 1), 0.0)
        return self.target_s[-1] + slope * (rows - K)

    def _plain(self, rows: int) -> float:
        """T(rows, rows): batched plain, as observed (or the single-row T(rows), scaled as observed)."""
        if rows <= 1:
            return self.target_s[0]
        seen = self.batch.plain.get(rows)
        return seen if seen is not None else self.batch.scale * self.single_row_guess(rows, 1)

    def _pass_seconds(self, rows: int, k: int) -> float:
        """One pass of `rows` rows x k tokens, unscaled."""
        return self._plain(rows) + max(self.single_row_guess(rows, k) - self.single_row_guess(rows, 1), 0.0)

    def ragged_seconds(self, lengths: list[int]) -> float:
        """One iteration of a ragged target whose row b scores lengths[b] new tokens (>= 1 each)."""
        if len(lengths) <= 1:
            return self.single_row_guess(1, lengths[0] if lengths else 1)
        plain = self._plain(len(lengths))
        priced = sum(self._pass_seconds(rows, k) for rows, k in passes(lengths))
        return plain + self.batch.extra * max(priced - plain, 0.0)

    def seconds(self, k: int, batch: int = 1, depth: int | None = None) -> float:
        """T(batch, k): one iteration over k new tokens in each of `batch` rows (one row: at a context of
        `depth` tokens; batches are priced depth-free)."""
        if batch <= 1:
            return self.target_seconds(k, depth)
        if self.ragged:
            return self.ragged_seconds([k] * batch)
        seen = self.batch.seconds.get((batch, k))
        return seen if seen is not None else self.batch.scale * self.single_row_guess(batch, k)

    def ratios(self) -> list[float]:
        """T(k) / T(1) for k = 1..K."""
        return [t / self.target_s[0] for t in self.target_s]

    def ceiling(self, gamma: int) -> float:
        """The most speculation can give with γ drafts: every draft accepted, (γ+1) / (T(γ+1)/T(1))."""
        return (gamma + 1) / self.step_cost(gamma)

    def step_cost(self, gamma: int, batch: int = 1, depth: int | None = None) -> float:
        """Cost of one iteration with γ drafts per row, in units of one plain (batched) target step (one
        row: both at a context of `depth` tokens)."""
        return self.step_costs(gamma, batch, depth)[gamma]

    def step_costs(self, widest: int, batch: int = 1, depth: int | None = None) -> list[float]:
        """[γ]: `step_cost(γ)` for γ = 0..widest, T(batch, 1..widest+1) looked up once (auto γ scans
        every width before every proposal; one row: the depth's place among the curves found once)."""
        seconds = (self.target_curve(widest + 1, depth) if batch <= 1
                   else [self.seconds(k, batch, depth) for k in range(1, widest + 2)])
        t1 = seconds[0]  # below: draft_seconds(g, batch) inline, in its arithmetic (priced every step)
        if self.copies:
            per_step = batch * self.draft_s_per_step
            return [1.0, *((per_step + t) / t1 for t in seconds[1:])]
        per_token = self.draft_s_per_token
        return [1.0, *((batch * (g * per_token) + seconds[g]) / t1 for g in range(1, widest + 1))]

    def predicted_speedup(self, alpha: float, gamma: int, depth: int | None = None) -> float:
        return expected_tokens(alpha, gamma) / self.step_cost(gamma, depth=depth)

    def best_gamma(self, alpha: float, depth: int | None = None) -> int:
        """The γ (0 = plain decoding) with the highest predicted speed-up; ties go to the smaller γ."""
        return max(range(self.max_gamma + 1), key=lambda g: (self.predicted_speedup(alpha, g, depth), -g))

    def depths(self) -> dict[str, list[float]]:
        """Measured depth -> T(k) there (k = 1..K), as refined so far."""
        return {str(depth): list(curve) for depth, curve, _ in self._curves()}

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["depth"]
        d["depths"] = self.depths()  # measured depth -> T(k)
        d["batch"] = {f"{b}x{k}": t for (b, k), t in self.batch.seconds.items()}
        if self.ragged:
            d["batch"] = {"plain": {str(b): t for b, t in self.batch.plain.items()}, "extra": self.batch.extra,
                          "scale": self.batch.scale}
        return {**d, "target_ratios": self.ratios()}


def measure_target(model: CausalLM, max_k: int = MAX_AUTO_GAMMA + 1, context: int = TARGET_DEPTHS[0],
                   reps: int = 4) -> list[float]:
    """Median seconds of a forward over k = 1..max_k new tokens on a warm cache of `context` tokens,
    measured at the k of MEASURED_K (and max_k) and interpolated linearly between them. The k values are
    interleaved across repetitions so machine noise spreads over all of them. A model whose context
    cannot hold `context` + max_k tokens is measured on a shorter warm cache (`fitting_depth`)."""
    context = fitting_depth(model, max_k, context)
    ks = sorted({k for k in MEASURED_K if k < max_k} | {max_k})
    gen = torch.Generator().manual_seed(0)
    model.reset()
    try:
        model.forward(torch.randint(0, model.vocab_size, (1, context), generator=gen))
        return _measure_at(model, context, ks, max_k, reps, gen)
    finally:
        model.reset()


def fitting_depth(model: CausalLM, max_k: int, depth: int) -> int:
    """`depth`, capped so that the model's context holds it and max_k more tokens."""
    return max(1, min(depth, model.max_length - max_k - 1))


def deeper_depths(model: CausalLM, max_k: int, base: int, depths: tuple[int, ...] = TARGET_DEPTHS) -> list[int]:
    """The depths of `depths` beyond `base` worth measuring on `model`: capped by its context, each at
    least twice the one before (closer ones would differ by noise)."""
    kept = [base]
    for depth in depths:
        depth = fitting_depth(model, max_k, depth)
        if depth >= 2 * kept[-1]:
            kept.append(depth)
    return kept[1:]


def measure_deeper(model: CausalLM, max_k: int, depths: list[int], reps: int = DEEP_REPS, base: int = 0,
                   budget_s: float = DEEP_PREFILL_S) -> tuple[list[int], list[list[float]]]:
    """T(1..max_k) at each of `depths` (ascending; `deeper_depths`), as `measure_target` but at DEEP_K
    only and `reps` times (they cost more) -> (the depths measured, T(k) at each). One cache serves all:
    it is prefilled to each depth in turn, in chunks; once the prefill has taken `budget_s` (a big model
    on a small CPU), the depth reached is the last one measured (if at least twice the one before)."""
    gen = torch.Generator().manual_seed(1)
    ks = sorted({k for k in DEEP_K if k < max_k} | {max_k})
    measured, curves, filled, spent = [], [], 0, 0.0
    model.reset()
    try:
        for depth in depths:
            while filled < depth and spent < budget_s:
                n = min(DEEP_PREFILL_CHUNK, depth - filled)
                t = time.perf_counter()
                model.forward(torch.randint(0, model.vocab_size, (1, n), generator=gen))
                synchronize(device_of(model))
                spent, filled = spent + time.perf_counter() - t, filled + n
            if filled < 2 * (measured[-1] if measured else base):
                break
            curves.append(_measure_at(model, filled, ks, max_k, reps, gen))
            measured.append(filled)
            if filled < depth:  # out of budget
                break
    finally:
        model.reset()
    return measured, curves


def _measure_at(model: CausalLM, context: int, ks: list[int], max_k: int, reps: int,
                gen: torch.Generator) -> list[float]:
    """T(1..max_k) on the model's warm cache of `context` tokens: medians at `ks`, linear between. Priced as
    decoding meets them: T(1) is a one-token step after one-token steps; a wider pass comes between
    one-token steps, so it is charged what changing shape costs it AND the step after it (llama.cpp builds
    a new graph for every new pass shape: ~0.5 ms per change, ~10% of a step, on a Zen 5 with the embedded
    model): each wider k is measured after another shape, and charged once more for the step after it."""
    times: dict[int, list[float]] = {k: [] for k in ks}
    steps: list[list[float]] = [[], []]  # one-token steps after the widest pass, after a one-token step

    def timed(k: int) -> float:
        """Seconds of one forward over k random tokens on the warm cache, which is then cut back."""
        ids = torch.randint(0, model.vocab_size, (1, k), generator=gen)
        t = time.perf_counter()
        model.forward(ids)
        synchronize(device_of(model))
        seconds = time.perf_counter() - t
        model.truncate(context)
        return seconds

    for rep in range(reps + 1):  # the first round warms up
        for k in ks:
            seconds = timed(k)
            if rep:
                times[k].append(seconds)
        for j in range(3):  # the first changes shape (after the widest k); the next two do not
            seconds = timed(1)
            if rep:
                steps[min(j, 1)].append(seconds)
    med = {k: statistics.median(ts) for k, ts in times.items()}
    one = min(med[1], statistics.median(steps[1]))
    # what a change of shape costs a pass: from the fastest of each kind (a step slowed by another process
    # is not a change of shape), and at most CHANGE_CAP of a step (a test suite's two workers measured
    # 20 ms beside a 12 ms step once, and auto γ then never drafted)
    change = min(max(min(steps[0]) - min(steps[1]), 0.0), CHANGE_CAP * one)
    out = []
    for k in range(1, max_k + 1):
        lo = max(j for j in ks if j <= k)
        hi = min(j for j in ks if j >= k)
        out.append(med[lo] if hi == lo else med[lo] + (med[hi] - med[lo]) * (k - lo) / (hi - lo))
    return [one, *(t + change for t in out[1:])]  # each wider k was measured after a change of shape


# Match-length buckets: bucket 0 = no match information (model drafters: the paper's one α).
BUCKET_EDGES = (1, 2, 3, 5, 9, 17, 33)  # bucket b >= 1 holds match lengths in [EDGES[b-1], EDGES[b])
COPY_PRIOR = (0.5, 0.6, 0.7, 0.8, 0.88, 0.93, 0.96)  # prior α per bucket 1..7: longer matches copy on
# The store (other requests' text) is a weaker witness at the same match length: measured on the
# bench's chat, edit, agent and agent-repeat with the embedded model, its copies of matches up to 8
# tokens were accepted 0.1-0.5 of the time (the context's 0.4-0.8); of 9 and more, 0.55-1.
STORE_PRIOR = (0.2, 0.3, 0.45, 0.6, 0.8, 0.9, 0.95)
MAX_PROBE_GAP = 512  # the most plain steps between two probes (`Probes`): a written-off copy is retried so often
REPRICE = 16  # calls `AutoGamma.shortest_paying` answers from its last pricing (until an outcome)
MAX_REST = 8  # the longest a batch sits out drafting (AutoGamma.resting): a copy found late loses at most this
FORGET = 0.97  # each proposal's outcome discounts its bucket's earlier evidence (memory ~30 proposals)


def bucket(match: int | None) -> int:
    """Match length -> bucket (0: unknown / not a copy)."""
    if not match:
        return 0
    if match < len(_BUCKETS):  # every proposal's α is looked up by its match length
        return _BUCKETS[match]
    return sum(match >= edge for edge in BUCKET_EDGES)


_BUCKETS = [sum(m >= edge for edge in BUCKET_EDGES) for m in range(2 * BUCKET_EDGES[-1])]


def sampling_mode(params) -> str:
    """"greedy" or "sampled": half of the key a copy's acceptance is learned under (`Acceptance.of`), since
    a sampled row keeps a copied token less often than a greedy one."""
    return "greedy" if params.greedy else "sampled"


class Acceptance:
    """What the engine has learned about one drafter: per match-length bucket, a Beta posterior of the
    per-token acceptance α (accepted drafts are successes, the first rejection a failure), with
    exponential forgetting. Shared by every request of an Engine (server, generate_batch, bench).

    Proposals of different kinds are priced apart (`of(key)`): a copying drafter's key says where the
    copy came from (the request's own context, or the store of earlier requests and siblings: the
    latter may be a weaker witness at the same match length) and whether the row samples. At T = 0 a
    copied token is kept when it is the argmax; at T > 0 it is kept with probability p(x), so a
    sampled row's copy is accepted less often and its long proposals are worth less: each kind learns
    its own α per match length, and auto γ and the auto drafter choose from the kind at hand. A kind
    starts from its source's prior (the store's is lower: STORE_PRIOR): a cold server's first requests
    otherwise pay for each short store copy until its bucket has learnt."""

    def __init__(self, prior_alpha: float = 0.3, prior_strength: float = 4.0, copy_prior: tuple = COPY_PRIOR):
        priors = (prior_alpha, *copy_prior)
        self.prior_alpha, self.prior_strength = prior_alpha, prior_strength
        self.successes = [a * prior_strength for a in priors]
        self.failures = [(1.0 - a) * prior_strength for a in priors]
        self.proposals = [0] * len(priors)
        self.keyed: dict[object, Acceptance] = {}

    def of(self, key: object = None) -> "Acceptance":
        """The posterior of one kind of proposal (None: this one)."""
        if key is None:
            return self
        if key not in self.keyed:
            store = isinstance(key, tuple) and key[:1] == ("store",)
            self.keyed[key] = Acceptance(self.prior_alpha, self.prior_strength, STORE_PRIOR if store else COPY_PRIOR)
        return self.keyed[key]

    def alpha(self, match: int | None = None) -> float:
        b = bucket(match)
        return self.successes[b] / (self.successes[b] + self.failures[b])

    def observe(self, proposed: int, accepted: int, match: int | None = None) -> None:
        if not proposed:
            return
        b = bucket(match)
        forget = FORGET if b else 1.0  # bucket 0 keeps the paper's stationary α
        self.successes[b] = forget * self.successes[b] + accepted
        self.failures[b] = forget * self.failures[b] + (accepted < proposed)
        self.proposals[b] += 1

    def to_dict(self) -> dict:
        out = {"bucket_edges": list(BUCKET_EDGES), "alpha": [self.alpha_of(b) for b in range(len(self.proposals))],
               "proposals": list(self.proposals)}
        if self.keyed:
            out["by_kind"] = {"/".join(map(str, k)) if isinstance(k, tuple) else str(k): a.to_dict()
                              for k, a in self.keyed.items()}
        return out

    def alpha_of(self, b: int) -> float:
        return self.successes[b] / (self.successes[b] + self.failures[b])


@dataclass
class Probes:
    """When auto γ next verifies one draft that it does not expect to pay (a probe of γ = 1), so that an
    acceptance it has written off gets measured again: after `gap` plain steps, the gap doubling after each
    probe up to MAX_PROBE_GAP. An engine keeps one per drafter across its requests (`Drafting.probes`):
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
        """A plain step with no lookup (`propose.next_lookup`): it counts towards the next probe, which
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
                 first_probe: int = 8, min_gain: float = 1.05, acceptance: Acceptance | None = None,
                 probes: Probes | None = None):
        self.cost, self.min_gain = cost, min_gain
        self.acceptance = acceptance if acceptance is not None else Acceptance(prior_alpha, prior_strength)
        self.probes = probes if probes is not None else Probes(first_probe)
        self.rest, self.rest_gap = 0, 1  # batched iterations left to sit out, and the next rest (`resting`)
        self.depth: int | None = None  # the context depth of the row being priced (set by propose.py)
        self._prices: tuple | None = None  # (key, step costs, their floors): `_step_costs`
        self._priced: dict[tuple, tuple[int, int]] = {}  # `_recall`: (an answer, calls it still serves)

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha(None)

    @property
    def max_gamma(self) -> int:
        return self.cost.max_gamma

    def next_gamma(self, batch: int = 1, depth: int | None = None) -> int:
        """γ before drafting (model drafters: every row expects the same)."""
        return self.choose([(None, self.max_gamma)], batch, depth)

    def speedup(self, rows: list[tuple], gamma: int, batch: int | None = None, depth: int | None = None) -> float:
        """Predicted speed-up of one iteration of width γ over plain decoding, for rows of (match
        length, tokens available to propose[, kind: see Acceptance.of]) in a batch of `batch` rows
        (default: these rows)."""
        tokens = sum(expected_tokens(self.acceptance.of(kind).alpha(m), min(gamma, avail)) for m, avail, kind in _kinds(rows))
        return tokens / len(rows) / self.cost.step_cost(gamma, batch or len(rows), self._depth(depth))

    def _depth(self, depth: int | None) -> int | None:
        return self.depth if depth is None else depth

    def _step_costs(self, batch: int, depth: int | None) -> tuple[list[float], list[float]]:
        """`step_cost(γ)` for γ = 0..max_gamma, and floor[γ] = the least of them from γ on: found once
        per iteration (every copy, model arm and cut of a step is priced against them; a width's cost
        does not depend on the widest priced)."""
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

        def price() -> int:
            for match in (edge for edge in BUCKET_EDGES if edge < longest):
                if any(self.best([(match, self.max_gamma, kind)], 1)[1] >= self.min_gain for kind in kinds):
                    return match
            return longest
        return self._recall(("copy", tuple(kinds), longest), price)

    def model_width(self, kind: object, k: int) -> int:
        """The width auto γ gives a model drafter's proposal of at most k tokens (`best` at its one α,
        `kind`), 0 where no width pays by min_gain: priced, as `shortest_paying` is, again after every
        outcome and every REPRICE calls (the auto drafter asks every step whether a model arm pays)."""
        def price(widest: int) -> int:
            width, gain = self.best([(None, widest, kind)], 1)
            return width if gain >= self.min_gain else 0
        width = self._recall(("model", kind), lambda: price(self.max_gamma))
        return width if width <= k else price(k)  # no width pays at k that does not at max_gamma

    def _recall(self, key: tuple, price) -> int:
        """price()'s answer for `key`, kept for REPRICE calls or until the next outcome (`observe`)."""
        known = self._priced.get(key)
        if known is None or known[1] <= 0:
            known = (price(), REPRICE + 1)
        self._priced[key] = (known[0], known[1] - 1)
        return known[0]

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
        count in `lengths`) took `seconds`, at a context of `depth` tokens (default: `self.depth`)."""
        self.cost.observe_target(k, seconds, batch, lengths, self._depth(depth))

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


def best_ragged(cost: CostModel, alphas: list[tuple[float, int]], base: list[int]) -> tuple[list[int], float]:
    """A ragged target's batch, its rows in cache order: row b scores base[b] tokens anyway and may add up
    to alphas[b][1] drafts, each accepted with alphas[b][0] -> (drafts per row, the predicted speed-up over
    scoring `base`). Drafts are added one at a time, each to the row whose next draft is likeliest
    accepted (its g-th: α^g more tokens expected), and the count with the best E[tokens] / cost is kept."""
    plain, batch = cost.ragged_seconds(base), len(base)
    widths, best, gain, tokens = [0] * batch, [0] * batch, 1.0, float(batch)  # tokens: expected out
    queue = [(-alpha, b) for b, (alpha, avail) in enumerate(alphas) if avail > 0]
    heapq.heapify(queue)
    while queue and -queue[0][0] >= 0.01:
        more, b = heapq.heappop(queue)
        widths[b], tokens = widths[b] + 1, tokens - more
        drafting = sum(cost.draft_seconds(w) for w in widths)
        seconds = cost.ragged_seconds([n + w for n, w in zip(base, widths)]) + drafting
        value = tokens / batch / (seconds / plain)
        if value > gain:
            best, gain = list(widths), value
        alpha, avail = alphas[b]
        if widths[b] < avail:
            heapq.heappush(queue, (more * alpha, b))
    return best, gain


def ragged_widths(cost: CostModel, alphas: list[tuple[float, int]], base: list[int], min_gain: float) -> list[int]:
    """`best_ragged`'s drafts where they are predicted to win by `min_gain`, else none. No probes (as
    `AutoGamma.choose` makes): here a probe costs a pass of its own (~T(1)), and what it would learn is
    learnt by the rows that do speculate."""
    widths, gain = best_ragged(cost, alphas, base)
    return widths if any(widths) and gain >= min_gain else [0] * len(base)


def _kinds(rows: list[tuple]) -> list[tuple]:
    """(match, available[, kind]) rows as (match, available, kind)."""
    return [(row[0], row[1], row[2] if len(row) > 2 else None) for row in rows]


def measure_drafter(drafter, vocab_size: int, params, k: int = 4, context: int = 100, reps: int = 5) -> float:
    """Median seconds per proposed token of `drafter` on a context that repeats itself (so that
    prompt lookup finds matches, as on grounded prompts)."""
    gen = torch.Generator().manual_seed(0)
    half = torch.randint(0, vocab_size, (context // 2,), generator=gen).tolist()
    ctx = half + half
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        proposal = drafter.propose(ctx, k, params, gen)
        times.append((time.perf_counter() - t) / max(len(proposal), 1))
    return statistics.median(times)
