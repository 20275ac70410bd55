"""Batched speculative decoding: B sequences, ONE target forward per iteration, per-row verification.

Rows advance by different amounts: the target's cache keeps a length per row (see
models/fast_llama.py), each row feeds [its last token, its drafts] padded to the longest proposal,
and after verification each row is rolled back to its own accepted prefix. Pad positions are
written to the cache but lie beyond the row's length, so no real query ever attends to them. Rows
that finish leave the batch (their cache rows are dropped), and new rows may join between
iterations (continuous batching, `BatchDecoder.add`). Each row has its own drafter, random
generator, sampling parameters and γ, so a row's output does not depend on which other rows share
its batch — except under auto γ, which prices an iteration by the batched T(B, k) and so drafts less
as the batch fills: a greedy row is still identical, a sampled row draws an equally exact but
different sample than it would alone.

Failures stay in their row: an exception in a row's own work (drafting, its law -- a grammar dead end,
a law that is not a distribution --, verification, commit) sets `row.error` and ends that row only;
the other rows of the iteration go on untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .constraints import TargetLaw
from .costmodel import AutoGamma
from .decode import budget, copying, draft
from .device import device_of
from .drafters.base import Drafter
from .errors import ExactSpecError
from .models.prefix_cache import cache_of, remember
from .sampling import LawError, SamplingParams, bad_laws, warp
from .stats import Stats, total
from .verify import accept_greedy, verify
from .verify_torch import verify_rows


def _prefill(target, prompts: list[list[int]]) -> None:
    """Cache every row's prompt[:-1]; identical prompts (n samples) share one prefill."""
    if all(p == prompts[0] for p in prompts):
        target.reset(1)
        if len(prompts[0]) > 1:
            target.forward_rows(torch.tensor([prompts[0][:-1]]), logits=False)
        target.select_rows(torch.zeros(len(prompts), dtype=torch.long))
        return
    target.reset(len(prompts))
    width = max(len(p) for p in prompts) - 1
    if width > 0:  # right-padded; each row is then cut back to its own length
        padded = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts])
        target.forward_rows(padded, logits=False)
    target.truncate_rows(torch.tensor([len(p) - 1 for p in prompts]))


def _check(target, rows: list["Row"]) -> None:
    prompts = [r.prompt for r in rows]
    if any(r.params.lenience != 1 for r in rows):  # its greedy rule needs un-warped laws the batch does not keep
        raise ExactSpecError("lenient (lossy) rows are not batched: decode them with decode()")
    if any(not p for p in prompts):
        raise ExactSpecError("a prompt is empty")
    if max(len(p) for p in prompts) >= target.max_length:
        raise ExactSpecError(f"a prompt does not fit the {target.max_length}-token context")


@dataclass(eq=False)
class Row:
    """One sequence of a batch, with everything that makes it decode exactly as it would alone."""

    key: object  # the caller's handle (decode_batch: the row's index)
    prompt: list[int]
    drafter: Drafter | None
    params: SamplingParams
    gamma: int | AutoGamma  # a shared AutoGamma is asked once per iteration for all its rows
    max_new_tokens: int
    generator: torch.Generator | None
    stats: Stats = field(default_factory=Stats)
    law: TargetLaw | None = None  # grammar / penalties / logprobs of this row (constraints.py)
    cancelled: bool = False  # set by the caller: the row leaves when the current iteration ends
    error: Exception | None = None  # this row failed alone; it leaves when the iteration ends
    done: bool = False  # EOS, max_new_tokens or the context limit: it leaves when the iteration ends
    context: list[int] = field(init=False)
    produced: int = 0
    started: float = 0.0

    def __post_init__(self) -> None:
        self.context = list(self.prompt)


class BatchDecoder:
    """The batched loop, one iteration at a time, so that rows can join between iterations.

        decoder = BatchDecoder(target)
        decoder.add(rows)                        # between iterations only
        while decoder.rows:
            for row, tokens in decoder.step():   # consume each step to its end
                ...                              # row.cancelled = True: it leaves after this step
    """

    def __init__(self, target, stop_on_eos: bool = True, verifier=verify, stats: Stats | None = None):
        self.target, self.stop_on_eos, self.verifier = target, stop_on_eos, verifier
        self.stats = stats if stats is not None else Stats()  # prefill time, batched target calls
        self.rows: list[Row] = []  # in cache-row order

    def start(self, rows: list[Row]) -> None:
        """Begin an empty batch with `rows`, prefilled together (one forward, padded if prompts differ;
        with a prefix cache, each distinct prompt joins through it instead)."""
        _check(self.target, rows)
        if self.rows:
            raise ExactSpecError("the batch is running: add rows instead")
        if cache_of(self.target) is not None:
            return self.add(rows)
        t0 = time.perf_counter()
        _prefill(self.target, [r.prompt for r in rows])
        for row in rows:
            row.stats.prefill_tokens += len(row.prompt) - 1
        self._admit(rows, time.perf_counter() - t0)

    def add(self, rows: list[Row]) -> None:
        """Prefill `rows` and append them to the batch (the rows it holds are untouched if this fails).
        Consecutive rows with the same prompt (a request's n samples) share one prefill."""
        _check(self.target, rows)
        t0 = time.perf_counter()
        if not self.rows:
            self.target.reset(0)
        try:
            i = 0
            while i < len(rows):
                copies = next((j for j in range(i, len(rows)) if rows[j].prompt != rows[i].prompt), len(rows)) - i
                reused = self.target.join(rows[i].prompt, copies) or 0
                for row in rows[i:i + copies]:
                    row.stats.cached_tokens += reused
                    row.stats.prefill_tokens += len(row.prompt) - 1 - reused
                i += copies
        except BaseException:
            self.target.select_rows(torch.arange(len(self.rows)))  # drop the rows that did join
            raise
        self._admit(rows, time.perf_counter() - t0)

    def _admit(self, rows: list[Row], prefill_s: float) -> None:
        self.stats.prefill_s += prefill_s
        now = time.perf_counter()
        for row in rows:
            row.stats.prefill_s += prefill_s
            row.started = now
        self.rows += rows

    @contextmanager
    def lend(self) -> Iterator[object]:
        """Use the target for something else between iterations (measuring its speed resets its
        cache); the batch's cache is put back afterwards."""
        saved = self.target.save_cache() if self.rows else None
        try:
            yield self.target
        finally:
            if saved is not None:
                self.target.restore_cache(saved)

    def step(self) -> Iterator[tuple[Row, list[int]]]:
        """One iteration: every row drafts, ONE target forward scores every draft, each row verifies
        its own. Yields (row, tokens) for each row; rows that are done, or that the caller cancels
        while they are yielded, leave the batch once the iteration ends."""
        rows = self.rows
        room = self.target.max_length - max(len(r.context) for r in rows)
        drafts, matches = self._draft(rows, room)  # per row: (ids [k], probs [k, V] | None, forced); match length
        width = max(len(d[0]) for d in drafts) + 1
        feed = torch.zeros(len(rows), width, dtype=torch.long)  # [A, K+1], zero-padded
        for j, (row, (ids, _, _)) in enumerate(zip(rows, drafts)):
            feed[j, : len(ids) + 1] = torch.cat([torch.tensor([row.context[-1]]), ids])
        t = time.perf_counter()
        logits = self.target.forward_rows(feed)  # [A, K+1, V]
        emitted = self._greedy(rows, drafts, logits)  # {j: tokens}: greedy rows need no [V] laws
        rest = [j for j in range(len(rows)) if j not in emitted and rows[j].error is None]  # against warped laws
        warped = logits if len(rest) == len(rows) else logits[rest]  # [R, K+1, V]
        target_probs = _warp_rows(warped, [rows[j].params for j in rest]) if rest else None  # [R, K+1, V]
        seconds = time.perf_counter() - t
        policy = next((r.gamma for r in rows if isinstance(r.gamma, AutoGamma)), None)
        if policy is not None:  # T(B, k) is the target's: one observation serves every policy
            policy.observe_step(width, seconds, len(rows))
        if rest:
            self._laws(rows, drafts, logits, rest, target_probs)
        position = {j: i for i, j in enumerate(rest)}
        rest = [j for j in rest if rows[j].error is None]
        if rest and self.verifier is verify and device_of(self.target).type != "cpu":
            probs = target_probs[[position[j] for j in rest]] if len(rest) < len(position) else target_probs
            emitted.update(zip(rest, _verify_on_device([rows[j] for j in rest], [drafts[j] for j in rest], probs)))

        keep_lengths, still = [], []
        for j, (row, (ids, probs, forced)) in enumerate(zip(rows, drafts)):
            laws = target_probs[position[j]] if j in position else None  # [K+1, V]
            if row.error is None:
                try:
                    keep, out = self._verify(row, ids, probs, laws, forced, emitted.get(j), matches[j])
                except Exception as e:  # this row alone fails
                    row.error = e
            if row.error is not None:
                keep, out, row.done = len(row.context), [], True
            keep_lengths.append(keep)
            yield row, out
            if not row.done and not row.cancelled:
                still.append(j)
        self.stats.target_calls += 1
        self.target.truncate_rows(torch.tensor(keep_lengths))
        kept = set(still)
        for j, row in enumerate(rows):
            if j not in kept:  # its KV (prompt + generated) goes to the prefix cache, if any
                remember(self.target, row.context, len(row.prompt), row=j, cached=keep_lengths[j])
        if len(still) < len(rows):
            order = _compact(still)
            self.target.select_rows(torch.tensor(order, dtype=torch.long))
            self.rows = [rows[j] for j in order]

    @staticmethod
    def _laws(rows: list[Row], drafts, logits: torch.Tensor, rest: list[int], target_probs: torch.Tensor) -> None:
        """Fill the laws [K+1, V] of the `rest` rows that have one of their own (grammar, penalties,
        logprobs) into target_probs (row i is rows[rest[i]]); a row whose law fails or is not a
        distribution (NaN, no mass) gets `error` set."""
        for i, j in enumerate(rest):
            law, ids = rows[j].law, drafts[j][0]
            if law is not None and not law.trivial:
                try:
                    target_probs[i, : len(ids) + 1] = law.probs(logits[j, : len(ids) + 1], ids.tolist())
                except Exception as e:
                    rows[j].error = e
        widths = torch.tensor([len(drafts[j][0]) + 1 for j in rest], device=target_probs.device)
        for i in bad_laws(target_probs, widths).tolist():  # one check (one host sync) for all rows
            rows[rest[i]].error = rows[rest[i]].error or LawError()

    def _draft(self, rows: list[Row], room: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None, int]], list[int]]:
        """Every row's drafts (ids, probs, grammar-forced count) and match lengths, as decode.propose
        makes them for one row: grammar-forced tokens first (outside γ), then the drafter's `budget`
        (auto asked once per policy); rows of copying drafters under auto are then cut to one width of
        the drafter's part per policy, priced by T(B, width + 1) for the whole batch."""
        proposals, wants = [], {}
        for row in rows:
            cap = min(row.max_new_tokens - row.produced - 1, room - 1)
            if cap <= 0 or (not isinstance(row.gamma, AutoGamma) and row.gamma <= 0):
                proposals.append((None, 0))
                continue
            key = (id(row.gamma), copying(row.drafter, row.gamma))  # auto is asked once per policy
            if key not in wants:
                wants[key] = budget(row.drafter, row.gamma, len(rows))
            try:
                proposals.append(draft(row.drafter, wants[key], row.context, cap, row.params, row.generator, row.law))
            except Exception as e:  # this row alone fails
                row.error = e
                proposals.append((None, 0))
        widths = {}  # per copying policy
        for row, (proposal, forced) in zip(rows, proposals):
            if copying(row.drafter, row.gamma):
                widths.setdefault(id(row.gamma), (row.gamma, []))[1].append(
                    (proposal.match, len(proposal) - forced) if proposal is not None else (None, 0))
        widths = {key: policy.choose(members, len(rows)) for key, (policy, members) in widths.items()}
        drafts, matches = [], []
        for row, (proposal, forced) in zip(rows, proposals):
            if proposal is not None and copying(row.drafter, row.gamma):
                proposal = proposal.head(forced + widths[id(row.gamma)])
            if proposal is None or len(proposal) == 0:
                drafts.append((torch.zeros(0, dtype=torch.long), None, 0))
                matches.append(0)
            else:
                drafts.append((proposal.ids, proposal.probs, forced))
                matches.append(proposal.match)
        return drafts, matches

    def _greedy(self, rows: list[Row], drafts, logits: torch.Tensor) -> dict[int, list[int]]:
        """The emitted tokens of rows verified without warped [V] laws (standard verifier only): greedy
        rows take the argmax acceptance, greedy rows under a grammar their law's shortcut (a mask only
        where the grammar refuses the argmax). Same tokens as `verify` on one-hot laws, ties included."""
        if self.verifier is not verify:
            return {}
        out, argmax = {}, None
        for j, (row, (ids, _, _)) in enumerate(zip(rows, drafts)):
            if row.error is not None:
                continue
            if row.law is not None and row.law.greedy_fast:
                try:
                    out[j] = row.law.greedy(logits[j, : len(ids) + 1], ids.tolist())
                except Exception as e:  # a grammar dead end: this row alone fails
                    row.error = e
            elif row.params.greedy and (row.law is None or row.law.trivial):
                argmax = logits.argmax(-1).tolist() if argmax is None else argmax  # [A][K+1], one copy
                out[j] = accept_greedy(ids.tolist(), argmax[j][: len(ids) + 1])
        return out

    def _verify(self, row: Row, ids: torch.Tensor, probs: torch.Tensor | None, target_probs: torch.Tensor | None,
                forced: int = 0, emitted: list[int] | None = None, match: int = 0) -> tuple[int, list[int]]:
        """Accept a prefix of the row's drafts against its laws [K+1, V] (or take `emitted`, verified
        already); returns (cache length to keep, tokens emitted)."""
        k = len(ids)
        if emitted is None:
            emitted = self.verifier(ids.tolist(), probs, target_probs[: k + 1], row.generator)
        n = len(emitted) - 1
        if row.drafter is not None and k > forced:  # the drafter's own part (after the forced tokens)
            row.drafter.observe(k - forced, max(0, n - forced))
            if isinstance(row.gamma, AutoGamma):
                row.gamma.observe(k - forced, max(0, n - forced), match=match)
        keep = len(row.context) + n
        emitted = emitted[: row.max_new_tokens - row.produced]
        eos = self.target.eos_token_ids if self.stop_on_eos else ()
        eos_at = next((i for i, t in enumerate(emitted) if t in eos), None)
        if eos_at is not None:
            emitted = emitted[: eos_at + 1]
        if row.law is not None:
            row.law.commit(emitted, min(n, len(emitted)))
        row.stats.record(k, n, len(emitted), row.drafter.name if row.drafter is not None else None, forced,
                         min(forced, n))
        row.context += emitted
        row.produced += len(emitted)
        row.stats.decode_s = time.perf_counter() - row.started
        row.done = (eos_at is not None or row.produced >= row.max_new_tokens
                    or len(row.context) >= self.target.max_length)
        return keep, emitted



def _warp_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [A, K+1, V] -> probs [A, K+1, V], each row warped with its own parameters."""
    if all(p == params[0] for p in params):
        return warp(logits, params[0])
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for p in dict.fromkeys(params):  # rows sharing parameters are warped together
        rows = torch.tensor([j for j, q in enumerate(params) if q == p], device=logits.device)
        probs[rows] = warp(logits[rows], p)
    return probs


def _verify_on_device(rows: list[Row], drafts, target_probs: torch.Tensor) -> list[list[int]]:
    """Every row's emitted tokens from ONE batched tensor verification (verify_torch.verify_rows) on
    the laws' device; each row draws its γ+1 uniforms from its own generator exactly as the per-row
    verifier does, so outputs do not change. Only the ids come back to the host."""
    A, width = target_probs.shape[:2]
    draft_ids = torch.zeros(A, width - 1, dtype=torch.long)
    uniforms = torch.zeros(A, width)
    gammas = torch.tensor([len(d[0]) for d in drafts], dtype=torch.long)
    with_probs = any(d[1] is not None for d in drafts)
    draft_probs = torch.zeros(target_probs.shape[0], width - 1, target_probs.shape[-1], device=target_probs.device) \
        if with_probs else None
    for j, (row, (ids, probs, _)) in enumerate(zip(rows, drafts)):
        k = len(ids)
        draft_ids[j, :k] = ids
        uniforms[j, : k + 1] = torch.rand(k + 1, generator=row.generator)
        if draft_probs is not None:  # rows with point-mass proposals get one-hot laws
            draft_probs[j, :k] = probs.to(target_probs.device) if probs is not None else \
                torch.nn.functional.one_hot(ids.to(target_probs.device), target_probs.shape[-1]).float()
    accepted, nxt = verify_rows(draft_ids, gammas, draft_probs, target_probs, uniforms)
    accepted, nxt = torch.stack([accepted, nxt]).tolist()
    return [drafts[j][0][: accepted[j]].tolist() + [nxt[j]] for j in range(A)]


def _compact(still: list[int]) -> list[int]:
    """An order of the surviving rows that moves the fewest cache rows: survivors already among the
    first len(still) slots stay put, the others fill the holes left by the rows that leave."""
    kept, tail = set(still), [j for j in still if j >= len(still)]
    return [j if j in kept else tail.pop() for j in range(len(still))]


def decode_batch(
    target,  # a batched CausalLM: forward_rows, truncate_rows, select_rows, reset(batch)
    drafters: list[Drafter | None],
    prompts: list[list[int]],
    params: SamplingParams,
    gamma: int | AutoGamma,
    max_new_tokens: int,
    generators: list[torch.Generator | None],
    row_stats: list[Stats] | None = None,
    batch_stats: Stats | None = None,
    cancelled: set[int] | None = None,
    stop_on_eos: bool = True,
    verifier=verify,
    laws: list[TargetLaw | None] | None = None,
) -> Iterator[tuple[int, list[int]]]:
    """Yield (row, tokens) each time a row accepts tokens. A row stops at EOS, max_new_tokens, the
    context limit, or when the caller adds its index to `cancelled`. An AutoGamma policy chooses one
    γ per iteration for the whole batch, priced by the batched T(B, k), and learns from every row's outcome."""
    n_rows = len(prompts)
    row_stats = row_stats if row_stats is not None else [Stats() for _ in range(n_rows)]
    batch_stats = batch_stats if batch_stats is not None else Stats()
    cancelled = cancelled if cancelled is not None else set()
    decoder = BatchDecoder(target, stop_on_eos, verifier, batch_stats)
    laws = laws if laws is not None else [None] * n_rows
    decoder.start([Row(r, prompts[r], drafters[r], params, gamma, max_new_tokens, generators[r], row_stats[r], laws[r])
                   for r in range(n_rows)])
    t_start = time.perf_counter()
    while decoder.rows:
        for row, tokens in decoder.step():
            if row.error is not None:
                raise row.error
            yield row.key, tokens
            row.cancelled = row.key in cancelled
    batch_stats.decode_s += time.perf_counter() - t_start
    _sum_rows_into(batch_stats, row_stats)


def _sum_rows_into(batch_stats: Stats, row_stats: list[Stats]) -> None:
    """Batch counters = sums over rows, except target calls (one batched forward serves all rows)."""
    rows = total(row_stats)
    for name in ("draft_calls", "proposed", "accepted", "rejections", "emitted", "accepted_per_position",
                 "cached_tokens", "prefill_tokens", "drafts_by", "forced", "forced_accepted"):
        setattr(batch_stats, name, getattr(rows, name))
