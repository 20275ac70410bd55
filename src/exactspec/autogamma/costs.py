"""What one iteration costs: a cost model that knows verification is not free.

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

The policy that chooses γ from these prices is `policy.py`; what a copy is worth, `acceptance.py`;
the measurements these prices start from (timed forwards) are `measure.py`, this room's one file with I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..speculative.theory import expected_tokens


TARGET_WEIGHT = 0.2  # how far one real iteration moves T(k)
NEAR = 4  # a k-token pass also moves the widths up to this far from k, by half per token of distance: a
# width auto γ has stopped choosing since its price rose learns from its neighbours' passes
MAX_AUTO_GAMMA = 32  # the longest proposal auto may choose: T(k) is measured up to k = 33
TARGET_DEPTHS = (100, 1000, 3000)  # context depths T(k) is measured at (capped by the target's context)


@dataclass
class DepthCosts:
    """T(k) at contexts deeper than the one `CostModel.target_s` was measured at (`base` tokens), and how
    many real iterations refined each (as `target_observations`). Shared by every drafter's cost model,
    like `target_s`. No depths: depth is not priced (every row costs `target_s`)."""

    base: int = 0  # the depth target_s was measured at
    depths: list[int] = field(default_factory=list)  # ascending, each > base
    seconds: list[list[float]] = field(default_factory=list)  # [D][K]: T(k) at depths[d]
    observations: list[list[int]] = field(default_factory=list)  # [D][K]
    extra_at: list[list[float]] = field(default_factory=list)  # [D][K]: as CostModel.extra_at, per depth

    def __post_init__(self) -> None:
        if len(self.observations) != len(self.seconds):
            self.observations = [[0] * len(row) for row in self.seconds]
        if len(self.extra_at) != len(self.seconds):
            self.extra_at = [[row[0]] * len(row) for row in self.seconds]


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


def _as_priced(curve: list[float], extra_at: list[float], start: int, stop: int) -> list[float]:
    """curve[start:stop] as auto γ prices it: T(1), and each width's extra over T(1) as timed in this
    process (`CostModel.extra_at` 0), or, for a width no pass of its own has timed yet, scaled down by
    how far T(1) has fallen since the table was measured (`extra_at` that T(1)), never up.

    One-token steps move T(1), and every width by as much (`observe_target`): a table measured while
    the machine was slow, then T(1) refined down as its steps ran faster, kept the wide passes' slow
    extras, so they looked dear, were never chosen, and never measured again (`make run`'s demo, whose
    answer copies its prompt, then drafted almost nothing: docs/drafters.md). Priced so, a table that is
    wrong errs towards trying a wide pass, whose time then corrects it. Once timed, an extra is priced as
    timed: T(1) moves with the memory and the threads' waking far more than an extra row's compute does,
    and scaling timed extras by every dip of a noisy T(1) ratcheted them down to about half their cost,
    so chat and paraphrases drafted at a loss (measured in docs/drafters.md)."""
    one = curve[0]
    return [t if k == 0 or extra_at[k] <= 0.0 else one + (t - one) * min(1.0, one / extra_at[k])
            for k, t in enumerate(curve[start:stop], start)]


def _step(seen: list[int], k: int, ratio: float, share: float) -> float:
    """How far one observation moves T(k) (relatively) at a measured depth given `share` of it (its
    observed / predicted `ratio` clipped): a running mean over a width's first timings in this process,
    then TARGET_WEIGHT, so that a table measured on a busy machine is replaced within a few iterations.
    Counts the observation in seen[k - 1] where it has most of the share."""
    step = max(TARGET_WEIGHT, 1.0 / (seen[k - 1] + 1)) * share * (ratio - 1.0)
    seen[k - 1] += share >= 0.5
    return step


def _shift(curve: list[float], seen: list[int], ratio: float, share: float) -> None:
    """A one-token step observed at `ratio` x T(1): T(1) moves, and every width by as much (what every
    pass pays once: reading the weights), in place (the list is shared)."""
    shift = curve[0] * _step(seen, 1, ratio, share)
    curve[:] = [t + shift for t in curve]


def passes(lengths: list[int]) -> list[tuple[int, int]]:
    """The passes over the model of one unpadded iteration whose row b scores lengths[b] tokens, as
    (rows, tokens per row): llama.cpp's split of a batch over one KV stream per row (llama_batch_allocr::
    split_equal, sequential) takes the first row with tokens left and the adjacent rows after it that
    have tokens left, and as many tokens from each as the shortest of them has."""
    left, out, rows, start = list(lengths), [], len(lengths), 0
    while True:
        while start < rows and left[start] <= 0:  # rows before the first with tokens left stay done
            start += 1
        if start == rows:
            return out
        end = start
        while end + 1 < rows and left[end + 1] > 0:
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
    # [K]: T(1) when the table that gave what each width adds over it was measured, 0 once a pass of
    # that width timed it in this process (`_as_priced`; filled in place where empty, so a list the cost
    # models of one target share stays shared)
    extra_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.target_observations:
            self.target_observations = [0] * len(self.target_s)
        if not self.extra_at:
            self.extra_at[:] = [self.target_s[0]] * len(self.target_s)

    def _curves(self) -> list[tuple[int, list[float], list[int], list[float]]]:
        """(depth, T(k) there, its observation counts, `extra_at` there), shallowest first."""
        d = self.depth
        return [(d.base, self.target_s, self.target_observations, self.extra_at),
                *zip(d.depths, d.seconds, d.observations, d.extra_at)]

    def _at_base(self, depth: int | None) -> bool:
        """Whether T(k) at `depth` is the base curve's (`target_s`) alone."""
        return depth is None or depth <= self.depth.base or not self.depth.depths

    def _span(self, depth: int | None) -> tuple[int, float]:
        """-> (i, w): T(k) at `depth` is (1 - w) · curve i + w · curve i+1 (w = 0: curve i alone; w > 1:
        extrapolated past the deepest)."""
        if self._at_base(depth):
            return 0, 0.0
        depths = [self.depth.base, *self.depth.depths]
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
            return _as_priced(self.target_s, self.extra_at, start, stop)
        curves = self._curves()
        lo, hi = (_as_priced(curve, at, start, stop) for _, curve, _, at in curves[i:i + 2])
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
        A one-token step moves T(1), and every T(k) by as much (what every pass pays once: reading the
        weights); a wider pass moves what T(k) costs beyond T(1) (each extra token's compute), and that
        of the widths near k by half as much per token of distance (`NEAR`). Each
        observation is clipped to [0.5, 2]x of its prediction, against outliers, and moves by the
        running mean's weight over its width's first timings in this process, then by TARGET_WEIGHT.
        The two parts drift apart on a shared machine (a CPU whose memory is busier at
        some times than others: T(1) moves, T(8) hardly), where a table that scaled every T(k) with
        T(1) priced wide passes at about half their cost (measured in docs/drafters.md). On a ragged
        target a batched iteration is priced by its rows' `lengths` (new tokens per row; default k
        each). A one-row iteration at `depth` moves the measured depths around it, each by its share of
        the interpolation (`target_seconds`): at a measured depth (or None: the base), that depth's
        T(k) alone."""
        if self.frozen or not 1 <= k <= len(self.target_s):
            return
        if k == 1 and batch == 1 and self._at_base(depth):  # a one-token step at the base: target_s alone moves
            return self.observe_plain([(seconds, depth)])
        self.version += 1
        if batch > 1 and self.ragged:
            return self._observe_ragged(lengths or [k] * batch, seconds)
        if batch > 1:
            return self._observe_batch(batch, k, seconds)
        one = self.target_seconds(1, depth)
        if k == 1:
            ratio = seconds / one
        else:  # what the pass took beyond T(1), against what T(k) predicts beyond it
            extra = self.target_seconds(k, depth) - one
            ratio = (seconds - one) / extra if extra > 0.0 else 1.0
        ratio = min(max(ratio, 0.5), 2.0)  # observed / predicted
        i, w = self._span(depth)
        curves = self._curves()
        for j, share in ((i, 1.0 - min(w, 1.0)), (i + 1, min(w, 1.0))):
            if share <= 0.0:
                continue
            _, curve, seen, extra_at = curves[j]
            if k == 1:
                _shift(curve, seen, ratio, share)
                continue
            step = _step(seen, k, ratio, share)
            one, extra = curve[0], _as_priced(curve, extra_at, k - 1, k)[0] - curve[0]
            for n in range(max(2, k - NEAR), min(len(curve), k + NEAR) + 1):  # widths near k, half as far a token
                if n != k:  # their extras as stored, so that one still priced from the table's T(1) is scaled once
                    curve[n - 1] = one + (curve[n - 1] - one) * (1.0 + step * 0.5 ** abs(n - k))
            curve[k - 1] = one + extra * (1.0 + step)
            extra_at[k - 1] = 0.0  # timed: priced as is from now on

    def observe_plain(self, steps: list[tuple[float, int | None]]) -> None:
        """One-row one-token steps of (seconds, depth), in the order they ran: each as `observe_target`
        takes it. A run at the base depth moves T(1) step by step and every width once, by as much as
        T(1) moved in all (what `_shift` after each would give)."""
        if self.frozen:
            return
        i = 0
        while i < len(steps):
            if not self._at_base(steps[i][1]):  # deeper: `observe_target` moves the depths around it
                self.observe_target(1, steps[i][0], 1, None, steps[i][1])
                i += 1
                continue
            one = start = self.target_s[0]
            while i < len(steps) and self._at_base(steps[i][1]):
                one += one * _step(self.target_observations, 1, min(max(steps[i][0] / one, 0.5), 2.0), 1.0)
                self.version += 1
                i += 1
            self.target_s[:] = [t + (one - start) for t in self.target_s]

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
            return self.target_seconds(rows)
        first, last = self.target_seconds(1), self.target_seconds(K)
        return last + max((last - first) / max(K - 1, 1), 0.0) * (rows - K)

    def _plain(self, rows: int) -> float:
        """T(rows, rows): batched plain, as observed (or the single-row T(rows), scaled as observed)."""
        if rows <= 1:
            return self.target_s[0]
        seen = self.batch.plain.get(rows)
        return seen if seen is not None else self.batch.scale * self.single_row_guess(rows, 1)

    def _pass_seconds(self, rows: int, k: int) -> float:
        """One pass of `rows` rows x k tokens, unscaled."""
        return self._plain(rows) + max(self.single_row_guess(rows, k) - self.single_row_guess(rows, 1), 0.0)

    def ragged_seconds(self, lengths: list[int], memo: dict[tuple[int, int], float] | None = None) -> float:
        """One iteration of a ragged target whose row b scores lengths[b] new tokens (>= 1 each). `memo`:
        each pass shape's price, kept across the many iterations one batch choice prices
        (policy.best_ragged: repricing every pass of every candidate was most of a choice's time)."""
        if len(lengths) <= 1:
            return self.single_row_guess(1, lengths[0] if lengths else 1)
        memo = {} if memo is None else memo
        plain, priced = self._plain(len(lengths)), 0.0
        for shape in passes(lengths):
            if shape not in memo:
                memo[shape] = self._pass_seconds(*shape)
            priced += memo[shape]
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
        """T(k) / T(1) for k = 1..K, as priced."""
        curve = self.target_curve(len(self.target_s))
        return [t / curve[0] for t in curve]

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
        """Measured depth -> T(k) there (k = 1..K), as refined so far and priced (`curves`)."""
        return {str(depth): curve for (depth, *_), curve in zip(self._curves(), self.curves())}

    def curves(self) -> list[list[float]]:
        """T(k) at each measured depth, shallowest first, as priced now (what `measure.save_refined`
        persists: a later start begins from these prices)."""
        return [_as_priced(curve, at, 0, len(curve)) for _, curve, _, at in self._curves()]

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["depth"]
        d["depths"] = self.depths()  # measured depth -> T(k)
        d["batch"] = {f"{b}x{k}": t for (b, k), t in self.batch.seconds.items()}
        if self.ragged:
            d["batch"] = {"plain": {str(b): t for b, t in self.batch.plain.items()}, "extra": self.batch.extra,
                          "scale": self.batch.scale}
        return {**d, "target_ratios": self.ratios()}
