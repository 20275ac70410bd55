"""The decode loop: B rows at once, ONE target forward per iteration. A lone generation is a batch of one.

Each iteration is four steps (`BatchDecoder.step`):

    propose  every row drafts: grammar-forced tokens first, then up to its γ of its drafter's
    score    ONE target forward over every row's [last token, drafts], right-padded to the widest
    accept   each row keeps a prefix of its drafts and one more token, by the rule it was given when it
             joined (`acceptance`: greedy argmax, greedy under a grammar, lenient greedy, or the
             speculative-sampling verifier on warped laws, on the host or batched on the device)
    commit   each row, once: drafter and auto-γ feedback, EOS / max_new_tokens, law, stats, context; then
             every row's cache is rolled back to its accepted prefix

Invariant: a row's cache holds its context[:-1]. Rows advance by different amounts: the target's cache
keeps a length per row (models/fast_llama.py), pad positions are written beyond a row's length, so no
real query ever attends to them. Rows that finish leave the batch (their cache rows are dropped) and
new rows may join between iterations (continuous batching, `BatchDecoder.add`). Each row has its own
drafter, random generator, sampling parameters and γ, so a row's output does not depend on which other
rows share its batch — except under auto γ, which prices an iteration by the batched T(B, k) and so
drafts less as the batch fills: a greedy row is still identical, a sampled row draws an equally exact
but different sample than it would alone. γ = 0 (or an empty proposal) is a plain autoregressive step
through the very same path: our own baseline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from .constraints import TargetLaw
from .costmodel import AutoGamma
from .device import device_of
from .drafters.base import Drafter, Proposal
from .errors import ExactSpecError
from .models.prefix_cache import cache_of, remember
from .sampling import SamplingParams, warp
from .stats import Stats, total
from .verify import accept_greedy, accept_greedy_lenient, verify
from .verify_torch import verify_rows


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
    done: bool = False  # EOS, max_new_tokens or the context limit: it leaves when the iteration ends
    context: list[int] = field(init=False)
    produced: int = 0
    started: float = 0.0
    rule: "Rule | None" = None  # how its drafts are accepted: set once, when it joins a decoder

    def __post_init__(self) -> None:
        self.context = list(self.prompt)
        self.stats.lenience = min(self.stats.lenience, self.params.lenience)
        self._decode_base = self.stats.decode_s  # a Stats carried over from earlier generations keeps its time


class Draft(NamedTuple):
    """One row's proposal for one iteration."""

    ids: list[int]  # [k] grammar-forced tokens first, then the drafter's
    probs: torch.Tensor | None  # [k, V] the laws they were drawn from; None: point masses
    forced: int  # how many lead ids are grammar-forced
    match: int  # copying drafters: the match length behind the proposal (auto γ's evidence)
    seconds: float  # time spent drafting


# --- propose ---------------------------------------------------------------------------------------

def copying(drafter: Drafter | None, gamma: int | AutoGamma) -> bool:
    """Auto γ cuts the proposals after drafting: a copying drafter under auto."""
    return isinstance(gamma, AutoGamma) and getattr(drafter, "copies", False)


def budget(drafter: Drafter | None, gamma: int | AutoGamma, rows: int = 1) -> int:
    """How many drafts the drafter may propose this iteration: a fixed γ; under auto, auto's γ for a
    batch of `rows` (chosen before drafting), or for a copying drafter all auto may use (cut afterwards
    by `AutoGamma.choose`, once the match length is known)."""
    if copying(drafter, gamma):
        return gamma.max_gamma
    return gamma.next_gamma(rows) if isinstance(gamma, AutoGamma) else gamma


def draft(drafter: Drafter | None, k: int, context: list[int], room: int, params: SamplingParams,
          generator: torch.Generator | None, law: TargetLaw | None = None) -> tuple[Proposal | None, int]:
    """-> (proposal | None, how many grammar-forced tokens lead it). With a law: the canonical tokens of
    the text the grammar forces (at most `room`, outside the drafter's budget k), then up to k of the
    drafter's from there."""
    if law is None:
        proposal = drafter.propose(context, min(k, room), params, generator) if drafter is not None and k > 0 else None
        return (proposal if proposal is not None and len(proposal) else None), 0
    forced = law.forced(room)
    k = min(k, room - len(forced))
    proposal = law.join(forced, drafter.propose(context + forced, k, params, generator, law=law)
                        if drafter is not None and k > 0 else None)
    return (proposal if proposal is not None and len(proposal) else None), len(forced)


def propose(rows: list[Row], room: int) -> list[Draft]:
    """Every row's drafts, at most `room` past the longest context: grammar-forced tokens first (outside
    γ), then the drafter's `budget` (auto asked once per policy); rows of copying drafters under auto
    are then cut to one width of the drafter's part per policy, priced by T(B, width + 1)."""
    proposals, wants = [], {}
    for row in rows:
        cap = min(row.max_new_tokens - row.produced - 1, room - 1)  # an iteration emits up to k + 1 tokens
        fixed = not isinstance(row.gamma, AutoGamma)
        if cap <= 0 or (fixed and row.gamma <= 0) or (row.drafter is None and row.law is None):
            proposals.append((None, 0, 0.0))
            continue
        t = time.perf_counter()
        key = (id(row.gamma), copying(row.drafter, row.gamma))  # auto is asked once per policy
        if key not in wants:
            wants[key] = budget(row.drafter, row.gamma, len(rows))
        proposal, forced = draft(row.drafter, wants[key], row.context, cap, row.params, row.generator, row.law)
        proposals.append((proposal, forced, time.perf_counter() - t))
    widths = _copy_widths(rows, proposals)
    drafts = []
    for row, (proposal, forced, seconds) in zip(rows, proposals):
        if proposal is not None and copying(row.drafter, row.gamma):
            proposal = proposal.head(forced + widths[id(row.gamma)])
        if proposal is None or len(proposal) == 0:
            drafts.append(Draft([], None, 0, 0, seconds))
        else:
            drafts.append(Draft(proposal.ids.tolist(), proposal.probs, forced, proposal.match, seconds))
    return drafts


def _copy_widths(rows: list[Row], proposals: list[tuple[Proposal | None, int, float]]) -> dict[int, int]:
    """Per auto policy of copying drafters: the one width of the drafter's part its rows are cut to."""
    members = {}
    for row, (proposal, forced, _) in zip(rows, proposals):
        if copying(row.drafter, row.gamma):
            members.setdefault(id(row.gamma), (row.gamma, []))[1].append(
                (proposal.match, len(proposal) - forced) if proposal is not None else (None, 0))
    return {key: policy.choose(found, len(rows)) for key, (policy, found) in members.items()}


# --- score -----------------------------------------------------------------------------------------

class Scored:
    """What ONE target forward gave the batch; each view is computed once, on first use by a rule."""

    def __init__(self, rows: list[Row], drafts: list[Draft], logits: torch.Tensor | None = None,
                 argmax: list[list[int]] | None = None):
        self.rows, self.drafts, self.logits = rows, drafts, logits  # logits [A, K+1, V]
        if argmax is not None:
            self.argmax = argmax

    @cached_property
    def argmax(self) -> list[list[int]]:
        """[A][K+1] the target's argmax at every fed position (NumPy on the CPU: no torch op overhead)."""
        x = self.logits
        return x.numpy().argmax(-1).tolist() if x.device.type == "cpu" else x.argmax(-1).tolist()

    @cached_property
    def laws(self) -> tuple[dict[int, int], torch.Tensor]:
        """(row -> its index i, laws [R, K+1, V]) for the rows whose rule verifies against target laws:
        each row's law transform (grammar, penalties) where it has one, else the warp of its params."""
        rest = [j for j, row in enumerate(self.rows) if row.rule.needs_laws]
        logits = self.logits if len(rest) == len(self.rows) else self.logits[rest]  # [R, K+1, V]
        shaped = [i for i, j in enumerate(rest) if self.rows[j].law is not None and not self.rows[j].law.trivial]
        if len(rest) == 1 and shaped:  # one row with a law (a lone generation): its laws as they come
            row, ids = self.rows[rest[0]], self.drafts[rest[0]].ids
            return {rest[0]: 0}, row.law.probs(logits[0, : len(ids) + 1], ids)[None]  # [1, k+1, V]
        if len(shaped) < len(rest):
            probs = _warp_rows(logits, [self.rows[j].params for j in rest])
        else:
            probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for i in shaped:
            row, ids = self.rows[rest[i]], self.drafts[rest[i]].ids
            probs[i, : len(ids) + 1] = row.law.probs(logits[i, : len(ids) + 1], ids)
        return {j: i for i, j in enumerate(rest)}, probs

    def law(self, j: int) -> torch.Tensor:
        """Row j's target laws [k+1, V]."""
        index, probs = self.laws
        return probs[index[j], : len(self.drafts[j].ids) + 1]

    @cached_property
    def on_device(self) -> dict[int, list[int]]:
        """Every device-verified row's emitted tokens, from ONE batched tensor verification."""
        index, probs = self.laws
        members = [j for j in index if self.rows[j].rule is ON_DEVICE]
        found = verify_on_device([self.rows[j] for j in members], [self.drafts[j] for j in members],
                                 probs[[index[j] for j in members]])
        return dict(zip(members, found))


def _warp_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [A, K+1, V] -> probs [A, K+1, V], each row warped with its own parameters."""
    if all(p == params[0] for p in params):
        return warp(logits, params[0])
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for p in dict.fromkeys(params):  # rows sharing parameters are warped together
        rows = torch.tensor([j for j, q in enumerate(params) if q == p], device=logits.device)
        probs[rows] = warp(logits[rows], p)
    return probs


# --- accept: one rule per row, chosen when it joins -----------------------------------------------

class Rule:
    """How a row turns its drafts and the scored window into emitted tokens (accepted drafts + one)."""

    needs_logits = True  # False: the target's argmax is all it reads (llama.cpp then skips the [k, V] copy)
    needs_laws = False  # it verifies against warped target laws (Scored.laws)

    def accept(self, scored: Scored, j: int) -> list[int]:
        raise NotImplementedError


class GreedyArgmax(Rule):
    """Temperature 0, no law: drafts kept while they equal the target's argmax (`verify` on one-hot laws)."""

    needs_logits = False

    def accept(self, scored: Scored, j: int) -> list[int]:
        ids = scored.drafts[j].ids
        return accept_greedy(ids, scored.argmax[j][: len(ids) + 1])


class GreedyMasked(Rule):
    """Temperature 0 under a grammar without penalties: a mask only where the grammar refuses the argmax."""

    def accept(self, scored: Scored, j: int) -> list[int]:
        ids = scored.drafts[j].ids
        return scored.rows[j].law.greedy(scored.logits[j, : len(ids) + 1], ids)


class GreedyLenient(Rule):
    """Temperature 0 with lenience L < 1 (LOSSY): compares the un-warped target law (verify.py)."""

    def accept(self, scored: Scored, j: int) -> list[int]:
        ids, row = scored.drafts[j].ids, scored.rows[j]
        probs = scored.logits[j, : len(ids) + 1].softmax(-1).cpu()  # [k+1, V]
        return accept_greedy_lenient(ids, probs, row.params.lenience)


class Sampled(Rule):
    """The speculative-sampling verifier, one row at a time on host memory (NumPy: per row it is the
    fastest on a CPU), or an injected verifier (tests) on the laws where they are."""

    needs_laws = True

    def __init__(self, verifier=verify, lenience: float = 1.0):
        self.verifier, self.host = verifier, verifier is verify
        self.options = {} if lenience == 1 else {"lenience": lenience}

    def accept(self, scored: Scored, j: int) -> list[int]:
        d, laws = scored.drafts[j], scored.law(j)
        probs = d.probs[: len(d.ids)] if d.probs is not None else None
        if self.host:  # the NumPy verifier reads host memory (no copy on the CPU)
            laws, probs = laws.cpu(), None if probs is None else probs.cpu()
        return self.verifier(d.ids, probs, laws, scored.rows[j].generator, **self.options)


class OnDevice(Rule):
    """The same verifier batched over rows as tensor ops (verify_torch.py): the laws stay on the GPU."""

    needs_laws = True

    def accept(self, scored: Scored, j: int) -> list[int]:
        return scored.on_device[j]


ARGMAX, MASKED, ON_DEVICE = GreedyArgmax(), GreedyMasked(), OnDevice()


def acceptance(params: SamplingParams, law: TargetLaw | None, verifier, device: torch.device) -> Rule:
    """A row's rule, decided once. `verifier`: an injected one (tests' seam; None = the standard
    verifier) sees every row's warped laws, greedy or not. Greedy rows read the argmax (or their law's
    masked argmax) where that gives the same tokens as `verify` on one-hot laws, ties included."""
    lenient = params.lenience != 1
    if verifier is not None:
        return Sampled(verifier, params.lenience)
    if params.greedy and not lenient and (law is None or law.trivial):
        return ARGMAX
    if params.greedy and not lenient and law.greedy_fast:
        return MASKED
    if params.greedy and law is None:  # lenient greedy compares the un-warped target law
        return GreedyLenient()
    if device.type != "cpu" and not lenient:
        return ON_DEVICE
    return Sampled(verify, params.lenience)


def verify_on_device(rows: list[Row], drafts: list[Draft], target_probs: torch.Tensor) -> list[list[int]]:
    """Every row's emitted tokens from ONE batched tensor verification (verify_torch.verify_rows) on
    the laws' device [A, K+1, V]; each row draws its γ+1 uniforms from its own generator exactly as the
    per-row verifier does, so outputs do not change. Only the ids come back to the host."""
    A, width = target_probs.shape[:2]
    draft_ids = torch.zeros(A, width - 1, dtype=torch.long)
    uniforms = torch.zeros(A, width)
    gammas = torch.tensor([len(d.ids) for d in drafts], dtype=torch.long)
    with_probs = any(d.probs is not None for d in drafts)
    draft_probs = torch.zeros(A, width - 1, target_probs.shape[-1], device=target_probs.device) if with_probs else None
    for j, (row, d) in enumerate(zip(rows, drafts)):
        k = len(d.ids)
        draft_ids[j, :k] = torch.tensor(d.ids, dtype=torch.long)
        uniforms[j, : k + 1] = torch.rand(k + 1, generator=row.generator)
        if draft_probs is not None:  # rows with point-mass proposals get one-hot laws
            ids = draft_ids[j, :k].to(target_probs.device)
            draft_probs[j, :k] = d.probs[:k].to(target_probs.device) if d.probs is not None else \
                torch.nn.functional.one_hot(ids, target_probs.shape[-1]).float()
    accepted, nxt = verify_rows(draft_ids, gammas, draft_probs, target_probs, uniforms)
    accepted, nxt = torch.stack([accepted, nxt]).tolist()
    return [drafts[j].ids[: accepted[j]] + [nxt[j]] for j in range(A)]


# --- the decoder ----------------------------------------------------------------------------------

class BatchDecoder:
    """The loop, one iteration at a time, so that rows can join between iterations.

        decoder = BatchDecoder(target)
        decoder.add(rows)                        # between iterations only
        while decoder.rows:
            for row, tokens in decoder.step():   # consume each step to its end
                ...                              # row.cancelled = True: it leaves after this step
    """

    def __init__(self, target, stop_on_eos: bool = True, verifier=verify, stats: Stats | None = None):
        self.target, self.stop_on_eos = target, stop_on_eos
        self.verifier = None if verifier is verify else verifier  # the test seam: an injected verifier
        self.stats = stats if stats is not None else Stats()  # prefill time, batched target calls
        self.rows: list[Row] = []  # in cache-row order
        self._argmax_forward = getattr(target, "forward_argmax", None)  # one-row llama.cpp: argmax in place

    def start(self, rows: list[Row]) -> None:
        """Begin an empty batch with `rows`, prefilled together (one forward, padded if prompts differ;
        with a prefix cache, each distinct prompt joins through it instead)."""
        self._check(rows)
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
        self._check(rows)
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
        saved = self.target.save_cache() if self.rows else None
        try:
            yield self.target
        finally:
            if saved is not None:
                self.target.restore_cache(saved)

    def step(self) -> Iterator[tuple[Row, list[int]]]:
        """One iteration: propose, score, accept, commit. Yields (row, tokens) for each row; rows that
        are done, or that the caller cancels while they are yielded, leave once the iteration ends."""
        rows = self.rows
        drafts = propose(rows, self.target.max_length - max(len(r.context) for r in rows))
        t = time.perf_counter()
        scored = self._score(rows, drafts)
        emitted = [row.rule.accept(scored, j) for j, row in enumerate(rows)]
        seconds = time.perf_counter() - t
        self._commit(rows, drafts, emitted, seconds)
        for row, tokens in zip(rows, emitted):
            yield row, tokens
        self._leave(rows)

    def _score(self, rows: list[Row], drafts: list[Draft]) -> Scored:
        """ONE target forward over feed [A, K+1]: each row's last token and drafts, zero-padded."""
        width = max(len(d.ids) for d in drafts) + 1
        feed = [[row.context[-1], *d.ids] + [0] * (width - 1 - len(d.ids)) for row, d in zip(rows, drafts)]
        if self._argmax_forward is not None and len(rows) == 1 and not rows[0].rule.needs_logits:
            return Scored(rows, drafts, argmax=[self._argmax_forward(feed[0])])
        return Scored(rows, drafts, logits=self.target.forward_rows(torch.tensor(feed)))  # [A, K+1, V]

    def _commit(self, rows: list[Row], drafts: list[Draft], emitted: list[list[int]], seconds: float) -> None:
        """The one commit: auto γ's T(B, k), then per row its feedback, tokens, law and stats (`emitted[j]`
        cut in place at EOS / max_new_tokens); then every row's cache rolled back to its accepted prefix."""
        policy = next((r.gamma for r in rows if isinstance(r.gamma, AutoGamma)), None)
        if policy is not None:  # T(B, k) is the target's: one observation serves every policy
            policy.observe_step(max(len(d.ids) for d in drafts) + 1, seconds, len(rows))
        self._keep = [len(row.context) + len(tokens) - 1 for row, tokens in zip(rows, emitted)]  # [A]
        for j, (row, d) in enumerate(zip(rows, drafts)):
            emitted[j] = self._commit_row(row, d, emitted[j], seconds)
        self.stats.target_calls += 1
        self.target.truncate_rows(self._keep)

    def _commit_row(self, row: Row, d: Draft, emitted: list[int], seconds: float) -> list[int]:
        """Feedback, EOS / max_new_tokens, law, stats and context of one row -> the tokens it emits."""
        k, n = len(d.ids), len(emitted) - 1  # drafts, accepted drafts
        if row.drafter is not None and k > d.forced:  # the drafter's own part (after the forced tokens)
            row.drafter.observe(k - d.forced, max(0, n - d.forced))
            if isinstance(row.gamma, AutoGamma):
                row.gamma.observe(k - d.forced, max(0, n - d.forced), d.seconds, d.match)
        emitted = emitted[: row.max_new_tokens - row.produced]
        eos = self.target.eos_token_ids if self.stop_on_eos else ()
        eos_at = next((i for i, t in enumerate(emitted) if t in eos), None)
        if eos_at is not None:
            emitted = emitted[: eos_at + 1]
        if row.law is not None:
            row.law.commit(emitted, min(n, len(emitted)))
        stats = row.stats
        stats.record(k, n, len(emitted), row.drafter.name if row.drafter is not None else None, d.forced,
                     min(d.forced, n))
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
        order = _compact(still)
        self.target.select_rows(torch.tensor(order, dtype=torch.long))
        self.rows = [rows[j] for j in order]


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


def _compact(still: list[int]) -> list[int]:
    """An order of the surviving rows that moves the fewest cache rows: survivors already among the
    first len(still) slots stay put, the others fill the holes left by the rows that leave."""
    kept, tail = set(still), [j for j in still if j >= len(still)]
    return [j if j in kept else tail.pop() for j in range(len(still))]


def decode_batch(
    target,  # a CausalLM with the batch methods: forward_rows, truncate_rows, select_rows, reset(batch)
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
