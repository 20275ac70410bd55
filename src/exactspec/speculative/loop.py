"""The decode loop: B rows at once, ONE target forward per iteration. A lone generation is a batch of one.

Each iteration is four steps (`BatchDecoder.step`):

    propose  every row drafts: grammar-forced tokens first, then up to its γ of its drafter's (propose.py)
    score    ONE target forward over every row's [last token, drafts], right-padded to the widest (a
             `ragged` target, batched llama.cpp, scores each row's own tokens only); what the rows
             read of it (argmax, logits, warped laws) is computed once, on first use (accept.Scored)
    accept   each row keeps a prefix of its drafts and one more token, by the rule it was given when it
             joined (accept.py: greedy argmax, greedy under a grammar, lenient greedy, or the
             speculative-sampling verifier on warped laws, on the host or batched on the device)
    commit   each row, once: drafter and auto-γ feedback, EOS / max_new_tokens, law, stats, context; then
             every row's cache is rolled back to its accepted prefix

A row's set-up (`propose.prepare`: its drafter reads the prompt, auto γ prices its first lookup) runs when
it joins, before its prompt is prefilled.

Invariant: a row's cache holds its context[:-1]. Rows advance by different amounts: the target's cache
keeps a length per row (models/fast_llama.py; one-row adapters: models/base.OneRow), pad positions are
written beyond a row's length, so no real query ever attends to them. Rows that finish leave the batch
(their cache rows are dropped) and new rows may join between iterations (continuous batching,
`BatchDecoder.add`). Each row has its own drafter, random generator, sampling parameters and γ, so a row's output does not depend on which other
rows share its batch — except under auto γ, which prices an iteration by the batched T(B, k) and so
drafts less as the batch fills: a greedy row is still identical, a sampled row draws an equally exact
but different sample than it would alone. γ = 0 (or an empty proposal) is a plain autoregressive step
through the very same path: our own baseline.

Failures stay in their row: an exception in a row's own work (drafting, its law -- a grammar dead end,
a law that is not a distribution (NaN, no mass) --, acceptance, commit) sets `row.error`; the row emits
nothing more and leaves when the iteration ends, the other rows of the iteration go on untouched.
`decode` and `decode_batch` raise that error; the server's worker answers that request alone with it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..device import device_of
from ..errors import ExactSpecError
from .prefix_cache import cache_of, remember
from ..stats import Stats, total
from .accept import Scored, acceptance
from .fixed_gamma import FixedGamma, as_policy
from .interfaces import ArgmaxSteps, CausalLM, Drafter, Finishing, GammaPolicy, RowContexts
from .law import TargetLaw
from .propose import prepare, propose
from .rows import Draft, Row
from .sampling import SamplingParams
from .verify import verify

# (draft ids [γ], draft probs [γ, V] | None, target probs [γ+1, V], generator[, lenience=L]) -> emitted tokens
Verifier = Callable[..., list[int]]


class BatchDecoder:
    """The loop, one iteration at a time, so that rows can join between iterations.

        decoder = BatchDecoder(target)
        decoder.add(rows)                        # between iterations only
        while decoder.rows:
            for row, tokens in decoder.step():   # consume each step to its end
                ...                              # row.cancelled = True: it leaves after this step
    """

    def __init__(self, target: CausalLM, stop_on_eos: bool = True, verifier: Verifier = verify,
                 stats: Stats | None = None, prefill_chunk: int | None = None):
        self.target, self.stop_on_eos = target, stop_on_eos
        self.verifier = None if verifier is verify else verifier  # the test seam: an injected verifier
        self.stats = stats if stats is not None else Stats()  # prefill time, batched target calls
        self.rows: list[Row] = []  # in cache-row order
        # set by an offline caller with nothing queued: the batch ends with its last row, and drafts are
        # priced by what they save the batch (propose); else (a server) by the tokens each row gains
        self.until_last = False
        # the adapter's optional capabilities (interfaces.py), checked once
        self._argmax_forward = target.forward_argmax if isinstance(target, ArgmaxSteps) else None  # one-row llama.cpp
        self._ragged = isinstance(target, RowContexts) and target.ragged  # batched llama.cpp: rows unpadded
        # chunked prefill (a target that can open, extend and copy a row): prompt tokens prefilled per
        # iteration while other rows decode; None: a joining prompt is prefilled whole in `add`
        chunked = isinstance(target, RowContexts) and target.chunked_prefill
        self.prefill_chunk = prefill_chunk if prefill_chunk and chunked else None
        self.joining: deque[Joining] = deque()  # requests whose prompts are being prefilled, oldest first
        self._failed: list[Row] = []  # joining rows whose prefill failed: yielded (with their error) next step

    @property
    def waiting(self) -> list[Row]:
        """Rows that joined but do not decode yet: their prompt is being prefilled, or their prefill failed."""
        return [row for j in self.joining for row in j.rows] + self._failed

    def start(self, rows: list[Row]) -> None:
        """Begin an empty batch with `rows`, prefilled together (one forward, padded if prompts differ;
        with a prefix cache or chunked prefill, each distinct prompt joins through `add` instead)."""
        self._check(rows)
        if self.rows or self.joining:
            raise ExactSpecError("the batch is running: add rows instead")
        if cache_of(self.target) is not None or self.prefill_chunk is not None:
            return self.add(rows)
        for row in rows:
            prepare(row)
        t0 = time.perf_counter()
        _prefill(self.target, [r.prompt for r in rows])
        for row in rows:
            row.stats.prefill_tokens += len(row.prompt) - 1
        self._admit(rows, time.perf_counter() - t0)

    def add(self, rows: list[Row]) -> None:
        """Prefill `rows` and append them to the batch (the rows it holds are untouched if this fails).
        Consecutive rows with the same prompt (a request's n samples) share one prefill. With chunked
        prefill they join the queue of `joining` requests instead, and each iteration prefills up to
        `prefill_chunk` of their prompt tokens before it decodes; with no row decoding, all at once here."""
        self._check(rows)
        for row in rows:
            prepare(row)
        if self.prefill_chunk is not None:
            if not self.rows and not self.joining:
                self.target.reset(0)
            self.joining += [Joining(group) for group in _same_prompt(rows)]
            if not self.rows:
                self._prefill_joining(None)
            return
        t0 = time.perf_counter()
        if not self.rows:
            self.target.reset(0)
        try:
            i = 0
            while i < len(rows):
                copies = next((j for j in range(i, len(rows)) if rows[j].prompt != rows[i].prompt), len(rows)) - i
                reused = self.target.append_rows(rows[i].prompt, copies) or 0
                for row in rows[i:i + copies]:
                    row.stats.cached_tokens += reused
                    row.stats.prefill_tokens += len(row.prompt) - 1 - reused
                i += copies
        except BaseException:
            self.target.select_rows(torch.arange(len(self.rows)))  # drop the rows that did join
            raise
        self._admit(rows, time.perf_counter() - t0)

    def _prefill_joining(self, budget: int | None) -> None:
        """Prefill up to `budget` prompt tokens of the joining requests, oldest first (None: all). A
        request whose prompt is complete gets its samples' copies and starts decoding; one whose prefill
        fails leaves with the error (the next `step` yields its rows), the other rows untouched. The
        target cuts each chunk (`prefill_chunk`), so that a prefill in chunks computes what a whole one
        does."""
        spent = 0
        while self.joining and (budget is None or spent < budget):
            j, seq = self.joining[0], len(self.rows)
            t0 = time.perf_counter()
            try:
                if j.rest is None:
                    reused, j.rest = self.target.open_row(j.rows[0].prompt, len(j.rows))
                    for row in j.rows:
                        row.stats.cached_tokens += reused
                        row.stats.prefill_tokens += len(j.rest)
                take = len(j.rest) if budget is None else min(len(j.rest), budget - spent)
                if take < len(j.rest):
                    take = self.target.prefill_chunk(seq, take)
                self.target.extend_row(seq, j.rest[:take])
                j.rest, spent = j.rest[take:], spent + take
                if not j.rest:
                    self.target.copy_row(seq, len(j.rows) - 1)
            except Exception as e:
                self.joining.popleft()
                self.target.drop_rows(seq)
                for row in j.rows:
                    row.error, row.done = e, True
                self._failed += j.rows
                continue
            j.seconds += time.perf_counter() - t0
            if j.rest:
                break
            self.joining.popleft()
            self._admit(j.rows, j.seconds)

    def cancel_joining(self, cancelled: Callable[[Row], bool]) -> list[Row]:
        """Joining requests none of whose rows is still wanted leave now, their cache row dropped -> those rows."""
        gone = []
        for j in list(self.joining):
            if all(cancelled(row) for row in j.rows):
                if j is self.joining[0] and j.rest is not None:
                    self.target.drop_rows(len(self.rows))
                self.joining.remove(j)
                gone += j.rows
        return gone

    def _check(self, rows: list[Row]) -> None:
        if any(not r.prompt for r in rows):
            raise ExactSpecError("the prompt is empty")
        longest = max(len(r.prompt) for r in rows)
        if longest >= self.target.max_length:
            raise ExactSpecError(f"prompt of {longest} tokens does not fit the {self.target.max_length}-token context")
        if not self.target.batched and len(self.rows) + len(rows) > 1:
            raise ExactSpecError(f"{type(self.target).__name__} holds one sequence: decode its rows one at a time")

    def _admit(self, rows: list[Row], prefill_s: float) -> None:
        self.stats.prefill_s += prefill_s
        now, device = time.perf_counter(), device_of(self.target)
        for row in rows:
            row.stats.prefill_s += prefill_s
            row.started = now
            row.rule = acceptance(row.params, row.law, self.verifier, device)
        self.rows += rows

    @contextmanager
    def lend(self) -> Iterator[object]:
        """Use the target for something else between iterations (measuring its speed resets its
        cache); the batch's cache is put back afterwards."""
        saved = self.target.save_cache() if self.rows or self.joining else None
        try:
            yield self.target
        finally:
            if saved is not None:
                self.target.restore_cache(saved)

    def step(self) -> Iterator[tuple[Row, list[int]]]:
        """One iteration: a chunk of the joining prompts, then propose, score, accept, commit. Yields
        (row, tokens) for each row; rows that are done, or that the caller cancels while they are
        yielded, leave once the iteration ends. Joining rows whose prefill failed are yielded first,
        with their error and no tokens."""
        if self.joining:
            self._prefill_joining(self.prefill_chunk if self.rows else None)
        failed, self._failed = self._failed, []
        for row in failed:
            yield row, []
        rows = self.rows
        if not rows:
            return
        eos = self.target.eos_token_ids if self.stop_on_eos else set()
        drafts = propose(rows, self.target.max_length - max(len(r.context) for r in rows), eos, self.until_last)
        t = time.perf_counter()
        scored = self._score(rows, drafts)
        emitted = [_accept(row, scored, j) for j, row in enumerate(rows)]
        emitted = [[] if row.error is not None else tokens for row, tokens in zip(rows, emitted)]
        seconds = time.perf_counter() - t
        self._commit(rows, drafts, emitted, seconds)
        for row, tokens in zip(rows, emitted):
            yield row, tokens
        self._leave(rows)

    def _score(self, rows: list[Row], drafts: list[Draft]) -> Scored:
        """ONE target forward over feed [A, K+1]: each row's last token and drafts, zero-padded (a
        `ragged` target scores each row's own tokens only, and zero-fills the rest of its logits)."""
        feed = [[row.context[-1], *d.ids] for row, d in zip(rows, drafts)]
        if self._argmax_forward is not None and len(rows) == 1 and not rows[0].rule.needs_logits:
            return Scored(rows, drafts, argmax=[self._argmax_forward(feed[0])])
        if self._ragged:  # a joining row being prefilled (the cache's last one) scores nothing
            feed += [[] for _ in range(self.target.batch_size - len(rows))]
        if self._ragged and not any(row.rule.needs_logits for row in rows):  # greedy rows: argmax in place
            return Scored(rows, drafts, argmax=self.target.forward_ragged_argmax(feed)[: len(rows)])
        if self._ragged:
            return Scored(rows, drafts, logits=self.target.forward_ragged(feed)[: len(rows)])  # [A, K+1, V]
        width = max(len(ids) for ids in feed)
        padded = [ids + [0] * (width - len(ids)) for ids in feed]
        return Scored(rows, drafts, logits=self.target.forward_rows(torch.tensor(padded)))  # [A, K+1, V]

    def _commit(self, rows: list[Row], drafts: list[Draft], emitted: list[list[int]], seconds: float) -> None:
        """The one commit: auto γ's T(B, k), then per row its feedback, tokens, law and stats (`emitted[j]`
        cut in place at EOS / max_new_tokens); then every row's cache rolled back to its accepted prefix."""
        policy = next((r.gamma for r in rows if not isinstance(r.gamma, FixedGamma)), None)
        if policy is not None:  # T(B, k) is the target's: one observation serves every policy that learns
            lengths = [len(d.ids) + 1 for d in drafts]
            policy.observe_step(max(lengths), seconds, len(rows), lengths=lengths)
        self._keep = [len(row.context) + len(tokens) - 1 for row, tokens in zip(rows, emitted)]  # [A]
        for j, (row, d) in enumerate(zip(rows, drafts)):
            if row.error is None:
                try:
                    emitted[j] = self._commit_row(row, d, emitted[j], seconds)
                except Exception as e:  # this row alone fails
                    row.error = e
            if row.error is not None:  # it leaves with no tokens from this iteration; its cache holds context[:-1]
                emitted[j], row.done, self._keep[j] = [], True, len(row.context) - 1
        self.stats.target_calls += 1
        self.target.truncate_rows(self._keep)

    def _commit_row(self, row: Row, d: Draft, emitted: list[int], seconds: float) -> list[int]:
        """Feedback, EOS / max_new_tokens, law, stats and context of one row -> the tokens it emits."""
        k, n = len(d.ids), len(emitted) - 1  # drafts, accepted drafts
        if row.drafter is not None and k > d.forced:  # the drafter's own part (after the forced tokens)
            row.drafter.observe(k - d.forced, max(0, n - d.forced))
            row.gamma.observe(k - d.forced, max(0, n - d.forced), d.seconds, d.match, d.kind)
        emitted = emitted[: row.max_new_tokens - row.produced]
        eos = self.target.eos_token_ids if self.stop_on_eos else ()
        eos_at = next((i for i, t in enumerate(emitted) if t in eos), None)
        if eos_at is not None:
            emitted = emitted[: eos_at + 1]
        if row.law is not None:
            row.law.commit(emitted, min(n, len(emitted)))
        stats = row.stats
        stats.record(k, n, len(emitted), row.drafter.name if row.drafter is not None else None, d.forced,
                     min(d.forced, n), row.rule.joint(d))
        stats.draft_s += d.seconds
        stats.verify_s += seconds
        row.context += emitted
        row.produced += len(emitted)
        stats.decode_s = row._decode_base + time.perf_counter() - row.started
        row.done = (eos_at is not None or row.produced >= row.max_new_tokens
                    or len(row.context) >= self.target.max_length)
        return emitted

    def _leave(self, rows: list[Row]) -> None:
        """Rows done or cancelled leave: their KV (prompt + generated) goes to the prefix cache, if any."""
        still = [j for j, row in enumerate(rows) if not row.done and not row.cancelled]
        if len(still) == len(rows):
            return
        kept = set(still)
        for j, row in enumerate(rows):
            if j not in kept:
                remember(self.target, row.context, len(row.prompt), row=j, cached=self._keep[j])
                _finish(row)
        order = _compact(still)
        joining = list(range(len(rows), self.target.batch_size))  # a prompt being prefilled moves up behind them
        self.target.select_rows(torch.tensor(order + joining, dtype=torch.long))
        self.rows = [rows[j] for j in order]


@dataclass(eq=False)
class Joining:
    """A request's rows (its n samples share one prompt) while their prompt is prefilled in chunks."""

    rows: list[Row]
    rest: list[int] | None = None  # prompt tokens still to prefill; None: its cache row is not opened yet
    seconds: float = 0.0  # prefill time so far


def _same_prompt(rows: list[Row]) -> list[list[Row]]:
    """Consecutive rows with the same prompt (a request's n samples), as groups."""
    groups: list[list[Row]] = []
    for row in rows:
        if groups and groups[-1][0].prompt == row.prompt:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _finish(row: Row) -> None:
    """Tell a row's γ policy (it keeps some timings until then: `GammaPolicy.finish`) and its drafter (a
    store-writing drafter keeps the last tokens) that its generation ended."""
    row.gamma.finish()
    if isinstance(row.drafter, Finishing):
        try:
            row.drafter.finish(row.context)
        except Exception:  # a drafter's bookkeeping never fails a finished row
            pass


def _accept(row: Row, scored: Scored, j: int) -> list[int]:
    """Row j's emitted tokens by its rule; [] with `row.error` set if it failed (here or before)."""
    if row.error is not None:
        return []
    try:
        return row.rule.accept(scored, j)
    except Exception as e:  # its law, its grammar, its verification: this row alone fails
        row.error = row.error or e  # the first failure is the cause
        return []


def _prefill(target, prompts: list[list[int]]) -> None:
    """Cache every row's prompt[:-1]; identical prompts (n samples) share one prefill. A ragged target
    takes each prompt at its own length; others get them right-padded, each row then cut back."""
    if all(p == prompts[0] for p in prompts):
        target.reset(1)
        if len(prompts[0]) > 1:
            target.forward_rows(torch.tensor([prompts[0][:-1]]), logits=False)
        target.select_rows(torch.zeros(len(prompts), dtype=torch.long))
        return
    target.reset(len(prompts))
    if isinstance(target, RowContexts) and target.ragged:
        target.forward_ragged([p[:-1] for p in prompts], logits=False)
        return
    width = max(len(p) for p in prompts) - 1
    if width > 0:  # right-padded; each row is then cut back to its own length
        padded = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts])
        target.forward_rows(padded, logits=False)
    target.truncate_rows(torch.tensor([len(p) - 1 for p in prompts]))


def _compact(still: list[int]) -> list[int]:
    """An order of the surviving rows that moves the fewest cache rows: survivors already among the
    first len(still) slots stay put, the others fill the holes left by the rows that leave."""
    kept, tail = set(still), [j for j in still if j >= len(still)]
    return [j if j in kept else tail.pop() for j in range(len(still))]


def decode_rows(target: CausalLM, rows: list[Row], batch_stats: Stats | None = None, stop_on_eos: bool = True,
                verifier: Verifier = verify) -> Iterator[tuple[Row, list[int]]]:
    """Decode `rows` as one batch: yield (row, tokens) each time a row accepts tokens; the caller sets
    `row.cancelled` to end a row early. A row's error is raised. `batch_stats` gets the batch's
    prefill and decode time, its batched target calls and the rows' counters summed."""
    batch_stats = batch_stats if batch_stats is not None else Stats()
    decoder = BatchDecoder(target, stop_on_eos, verifier, batch_stats)
    decoder.until_last = True  # the caller has the batch's rows only, and all of them at its end
    decoder.start(rows)
    t_start = time.perf_counter()
    while decoder.rows or decoder.waiting:
        for row, tokens in decoder.step():
            if row.error is not None:
                raise row.error
            yield row, tokens
    batch_stats.decode_s += time.perf_counter() - t_start
    _sum_rows_into(batch_stats, [row.stats for row in rows])


def decode_row(target: CausalLM, row: Row, stop_on_eos: bool = True, verifier: Verifier = verify) -> Iterator[int]:
    """One generation, a batch of one: yield its token ids as they are accepted (EOS included). The
    caller may stop early (stop strings) by closing the iterator; the row's error is raised."""
    decoder = BatchDecoder(target, stop_on_eos, verifier)
    decoder.start([row])
    try:
        while (decoder.rows or decoder.waiting) and row.max_new_tokens > 0:
            for _, tokens in decoder.step():
                yield from tokens
            if row.error is not None:  # its law is not a distribution, a grammar dead end, ...: it has left
                raise row.error
    except GeneratorExit:  # the caller stopped early (stop string, client gone): the cache is consistent
        remember(target, row.context, len(row.prompt))
        raise


def decode_batch(
    target: CausalLM,
    drafters: list[Drafter | None],
    prompts: list[list[int]],
    params: SamplingParams,
    gamma: int | GammaPolicy,
    max_new_tokens: int,
    generators: list[torch.Generator | None],
    row_stats: list[Stats] | None = None,
    batch_stats: Stats | None = None,
    cancelled: set[int] | None = None,
    stop_on_eos: bool = True,
    verifier: Verifier = verify,
    laws: list[TargetLaw | None] | None = None,
) -> Iterator[tuple[int, list[int]]]:
    """Yield (row, tokens) each time a row accepts tokens. A row stops at EOS, max_new_tokens, the
    context limit, or when the caller adds its index to `cancelled`. A γ policy (auto γ) chooses one
    γ per iteration for the whole batch, priced by the batched T(B, k), and learns from every row's outcome."""
    row_stats = row_stats if row_stats is not None else [Stats() for _ in prompts]
    cancelled = cancelled if cancelled is not None else set()
    laws = laws if laws is not None else [None] * len(prompts)
    gamma = as_policy(gamma)
    rows = [Row(r, prompts[r], drafters[r], params, gamma, max_new_tokens, generators[r], row_stats[r], laws[r])
            for r in range(len(prompts))]
    for row, tokens in decode_rows(target, rows, batch_stats, stop_on_eos, verifier):
        yield row.key, tokens
        row.cancelled = row.key in cancelled


def decode(
    target: CausalLM,
    drafter: Drafter | None,
    prompt_ids: list[int],
    params: SamplingParams,
    gamma: int | GammaPolicy,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    stats: Stats | None = None,
    stop_on_eos: bool = True,
    verifier: Verifier = verify,
    law: TargetLaw | None = None,
) -> Iterator[int]:
    """One generation, a batch of one through `BatchDecoder`: yield generated token ids as they are
    accepted. Stops at EOS (yielded), max_new_tokens or the context limit; the caller may stop early (stop strings) by closing the iterator.
    `gamma` is a fixed number of drafts per iteration, or a γ policy (auto γ) asked at each one.
    `law` (law.py): the per-position transform (grammar, penalties, logprobs) of `params`'
    law, applied to target and drafts alike; it also proposes grammar-forced tokens.
    `verifier`: the speculative-sampling rule (tests inject broken ones as negative controls)."""
    row = Row(0, prompt_ids, drafter, params, as_policy(gamma), max_new_tokens, generator,
              stats if stats is not None else Stats(), law)
    yield from decode_row(target, row, stop_on_eos, verifier)


def _sum_rows_into(batch_stats: Stats, row_stats: list[Stats]) -> None:
    """Batch counters = sums over rows, except target calls (one batched forward serves all rows); the
    lenience is the smallest any row used."""
    rows = total(row_stats)
    for name in ("draft_calls", "proposed", "accepted", "rejections", "emitted", "accepted_per_position",
                 "cached_tokens", "prefill_tokens", "drafts_by", "forced", "forced_accepted", "block_verified"):
        setattr(batch_stats, name, getattr(rows, name))
    batch_stats.lenience = min(batch_stats.lenience, rows.lenience)  # lenient rows batch too: say it
