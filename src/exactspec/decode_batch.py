"""Batched speculative decoding: B sequences, ONE target forward per iteration, per-row verification.

Rows advance by different amounts: the target's cache keeps a length per row (see
models/fast_llama.py), each row feeds [its last token, its drafts] padded to the longest proposal,
and after verification each row is rolled back to its own accepted prefix. Pad positions are
written to the cache but lie beyond the row's length, so no real query ever attends to them. Rows
that finish leave the batch (their cache rows are dropped). Each row has its own drafter and its own
random generator, so a row's output does not depend on which other rows share its batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .costmodel import AutoGamma
from .drafters.base import Drafter
from .errors import ExactSpecError
from .sampling import SamplingParams, warp
from .stats import Stats
from .verify import verify


def _prefill(target, prompts: list[list[int]]) -> None:
    """Cache every row's prompt[:-1]; identical prompts (n samples) share one prefill."""
    if all(p == prompts[0] for p in prompts):
        target.reset(1)
        if len(prompts[0]) > 1:
            target.forward_rows(torch.tensor([prompts[0][:-1]]))
        target.select_rows(torch.zeros(len(prompts), dtype=torch.long))
        return
    target.reset(len(prompts))
    width = max(len(p) for p in prompts) - 1
    if width > 0:  # right-padded; each row is then cut back to its own length
        padded = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts])
        target.forward_rows(padded)
    target.truncate_rows(torch.tensor([len(p) - 1 for p in prompts]))


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
) -> Iterator[tuple[int, list[int]]]:
    """Yield (row, tokens) each time a row accepts tokens. A row stops at EOS, max_new_tokens, the
    context limit, or when the caller adds its index to `cancelled`. An AutoGamma policy chooses one
    γ per iteration for the whole batch and learns from every row's outcome."""
    if any(not p for p in prompts):
        raise ExactSpecError("a prompt is empty")
    if max(len(p) for p in prompts) >= target.max_length:
        raise ExactSpecError(f"a prompt does not fit the {target.max_length}-token context")
    n_rows = len(prompts)
    row_stats = row_stats if row_stats is not None else [Stats() for _ in range(n_rows)]
    batch_stats = batch_stats if batch_stats is not None else Stats()
    cancelled = cancelled if cancelled is not None else set()
    t0 = time.perf_counter()
    _prefill(target, prompts)
    batch_stats.prefill_s += time.perf_counter() - t0

    contexts = [list(p) for p in prompts]
    produced = [0] * n_rows
    active = list(range(n_rows))  # original row ids, in cache-row order
    t_start = time.perf_counter()
    while active:
        room = target.max_length - max(len(contexts[r]) for r in active)
        want = gamma.next_gamma() if isinstance(gamma, AutoGamma) else gamma
        drafts = []  # per active row: (ids [k], probs [k, V] | None)
        for r in active:
            k = min(want, max_new_tokens - produced[r] - 1, room - 1)
            proposal = drafters[r].propose(contexts[r], k, params, generators[r]) if drafters[r] and k > 0 else None
            if proposal is None or len(proposal) == 0:
                drafts.append((torch.zeros(0, dtype=torch.long), None))
            else:
                drafts.append((proposal.ids[:k], None if proposal.probs is None else proposal.probs[:k]))
        width = max(len(ids) for ids, _ in drafts) + 1
        feed = torch.zeros(len(active), width, dtype=torch.long)  # [A, K+1], zero-padded
        for j, (r, (ids, _)) in enumerate(zip(active, drafts)):
            feed[j, : len(ids) + 1] = torch.cat([torch.tensor([contexts[r][-1]]), ids])
        target_probs = warp(target.forward_rows(feed), params)  # [A, K+1, V]

        keep_lengths, still = [], []
        for j, (r, (ids, probs)) in enumerate(zip(active, drafts)):
            k = len(ids)
            tokens, accepted = verifier(ids[None], None if probs is None else probs[None],
                                        target_probs[j : j + 1, : k + 1], generators[r])
            n = int(accepted[0])
            if drafters[r] is not None and k:
                drafters[r].observe(k, n)
                if isinstance(gamma, AutoGamma):
                    gamma.observe(k, n)
            keep_lengths.append(len(contexts[r]) + n)
            emitted = tokens[0, : n + 1].tolist()[: max_new_tokens - produced[r]]
            eos_at = next((i for i, t in enumerate(emitted) if stop_on_eos and t in target.eos_token_ids), None)
            if eos_at is not None:
                emitted = emitted[: eos_at + 1]
            row_stats[r].record(k, n, len(emitted))
            contexts[r] += emitted
            produced[r] += len(emitted)
            row_stats[r].decode_s = time.perf_counter() - t_start
            yield r, emitted
            done = eos_at is not None or produced[r] >= max_new_tokens or len(contexts[r]) >= target.max_length
            if not done and r not in cancelled:
                still.append(j)
        batch_stats.target_calls += 1
        target.truncate_rows(torch.tensor(keep_lengths))
        if len(still) < len(active):
            target.select_rows(torch.tensor(still, dtype=torch.long))
            active = [active[j] for j in still]
    batch_stats.decode_s += time.perf_counter() - t_start
    _sum_rows_into(batch_stats, row_stats)


def _sum_rows_into(batch_stats: Stats, row_stats: list[Stats]) -> None:
    """Batch counters = sums over rows, except target calls (one batched forward serves all rows)."""
    total = Stats()
    for s in row_stats:
        total = total.merge(s)
    for name in ("draft_calls", "proposed", "accepted", "rejections", "emitted", "accepted_per_position"):
        setattr(batch_stats, name, getattr(total, name))
