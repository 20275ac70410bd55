"""Step 1 of the loop: every row's drafts for one iteration (grammar-forced tokens, then its drafter's)."""

from __future__ import annotations

import time

import torch

from .interfaces import Drafter, Proposal, ReadsPrompt
from .law import TargetLaw
from .lookups import cannot_match, next_lookup, price_lookup
from .rows import Draft, Row
from .sampling import SamplingParams


def prepare(row: Row) -> None:
    """A row's set-up, before its prompt is prefilled: its drafter reads the prompt (`ReadsPrompt`), and auto
    γ prices its first lookup at the prompt's depth and tells whether it can find anything (`cannot_match`:
    a chat prompt ends with its template's opening of the answer, which a single-turn prompt holds once).
    The first iteration then runs right after the prefill without them, when the prefill has left the CPU's
    caches cold for Python (its work runs ~3x slower there: docs/drafters.md). A failure here is the row's
    alone (`row.error`), as in `propose`."""
    try:
        if isinstance(row.drafter, ReadsPrompt):
            row.drafter.read_prompt(row.prompt)
        if row.spaces is not None:
            row.gamma.depth = len(row.prompt)
            price_lookup(row)
            cannot_match(row)
    except Exception as e:
        row.error = e


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
    proposal = law.prepend_forced(forced, drafter.propose(context + forced, k, params, generator, law=law)
                        if drafter is not None and k > 0 else None)
    return (proposal if proposal is not None and len(proposal) else None), len(forced)


def before_eos(proposal: Proposal | None, forced: int, eos: set[int]) -> Proposal | None:
    """A point-mass proposal (a copy) cut before its first drafted end of sequence: an EOS drafted saves
    no pass (the pass that verifies it would have given it, as its bonus token) and what follows it is
    never used, while each drafted token widens the pass. A copy is a function of the context alone, so
    the cut is another deterministic proposal: exact. (A sampled draft is not cut: stopping where a
    sampled token is EOS would bias the tokens before it against their draft law q.)"""
    if proposal is None or proposal.probs is not None or not eos:
        return proposal
    tokens = proposal.tokens()
    at = next((i for i, t in enumerate(tokens) if i >= forced and t in eos), None)
    if at is None:
        return proposal
    return Proposal(tokens[:at], None, proposal.match) if at else None


def propose(rows: list[Row], room: int, eos: set[int] = frozenset(), until_last: bool = False) -> list[Draft]:
    """Every row's drafts, at most `room` past the longest context: grammar-forced tokens first (outside
    γ), then the drafter's `budget` (auto asked once per policy), a copy cut before a drafted EOS
    (`before_eos`; `eos`: the target's end-of-sequence ids); rows of copying drafters under auto
    are then cut to one width of the drafter's part per policy, priced by T(B, width + 1) (on a
    ragged target, to a width per row, priced by the passes they add; such a batch sits an iteration
    out while its copies keep being cut to nothing, `CutsCopies.resting`; `until_last`: the batch ends
    with its last row and no request waits for a row's place, so drafts are priced by what they save the
    batch, not the tokens a row gains: policy.batch_value). A row whose
    drafting raises gets `error` set and no drafts; the other rows' drafts are untouched."""
    proposals, wants, resting, looked = [], {}, {}, {}
    for row in rows:
        cap = min(row.max_new_tokens - row.produced - 1, room - 1)  # an iteration emits up to k + 1 tokens
        row.gamma.depth = len(row.context)  # its policy prices this iteration (and learns from its timing) here
        if cap <= 0 or row.plain or (row.drafter is None and row.law is None) or row.error is not None:
            proposals.append((None, 0, 0.0, None))
            continue
        # a copying row in a batch on a ragged target: priced by `ragged_widths`, and resting with its
        # policy while the batch's copies keep being cut to nothing (`CutsCopies.resting`: asked once per
        # iteration, before a row's own spacing below, so that the two wait side by side, not one after the other)
        in_batch = len(rows) > 1 and row.cuts is not None and row.cuts.ragged and row.law is None
        if in_batch:
            if id(row.cuts) not in resting:
                resting[id(row.cuts)] = row.cuts.resting()
            if resting[id(row.cuts)]:
                proposals.append((None, 0, 0.0, None))
                continue
        bounded = row.spaces is not None
        if bounded and len(row.context) < row.lookup_at and row.spaces.skip_lookup():
            proposals.append((None, 0, 0.0, None))
            continue
        if in_batch:  # this policy's batch looked this iteration (`batch_drafted` below)
            looked[id(row.cuts)] = row.cuts
        t = time.perf_counter()
        key = (id(row.gamma), row.copying)  # a policy is asked once per iteration
        if key not in wants:  # the policy's budget for the batch (`GammaPolicy.budget`)
            wants[key] = row.gamma.budget(len(rows), row.copying)
        try:
            if bounded:
                price_lookup(row)
            if bounded and cannot_match(row):
                proposal, forced = None, 0
            else:
                proposal, forced = draft(row.drafter, wants[key], row.context, cap, row.params, row.generator, row.law)
                if proposal is not None:
                    proposal = before_eos(proposal, forced, eos)
                if bounded:
                    next_lookup(row, proposal)
        except Exception as e:  # a drafter's or a grammar's failure: this row alone fails (no drafts)
            row.error, proposal, forced = e, None, 0
        proposals.append((proposal, forced, time.perf_counter() - t, kind(row) if proposal is not None else None))
    if not looked and all(p[0] is None for p in proposals):  # nothing drafted (most iterations): no pricing
        return [Draft([], None, 0, 0, seconds) for _, _, seconds, _ in proposals]
    widths = _copy_widths(rows, proposals, until_last)
    for policy in looked.values():  # a batch that looked this iteration: did any copy pay?
        policy.batch_drafted(any(widths.get(j, 0) for j, row in enumerate(rows) if row.gamma is policy))
    drafts = []
    for j, (row, (proposal, forced, seconds, copy_kind)) in enumerate(zip(rows, proposals)):
        keep = forced + widths[j] if proposal is not None and row.copying else None
        if proposal is None or len(proposal) == 0 or keep == 0:
            drafts.append(Draft([], None, 0, 0, seconds))
        else:  # cut as a list, not by torch calls (Proposal.tokens)
            probs = proposal.probs if keep is None or proposal.probs is None else proposal.probs[:keep]
            drafts.append(Draft(proposal.tokens()[:keep], probs, forced, proposal.match, seconds, copy_kind))
    return drafts


def kind(row: Row) -> tuple | None:
    """What auto γ prices a copying drafter's proposal by, besides its match length: where the copy
    came from (the drafter's `source`: its own context unless it says otherwise) and whether the row
    samples (acceptance.Acceptance)."""
    if row.copier is None or not row.copier.copies:
        return None
    return (row.copier.source or "context", row.mode)


def _copy_widths(rows: list[Row], proposals: list[tuple[Proposal | None, int, float, tuple | None]],
                 until_last: bool = False) -> dict[int, int]:
    """Row index -> the width its drafter's part is cut to, for the rows of copying drafters under auto:
    asked once per policy (`CutsCopies.choose`: one width for all its rows); on a ragged target in a
    batch, for all such rows together, each its own (policy.ragged_widths: every row's extra pass is
    priced, whichever request it belongs to)."""
    found = {}  # row index -> (its policy, (match, drafts available, kind))
    for j, (row, (proposal, forced, _, copy_kind)) in enumerate(zip(rows, proposals)):
        if row.cuts is not None:
            found[j] = (row.cuts, (proposal.match, len(proposal) - forced, copy_kind) if proposal is not None
                        else (None, 0, None))
    if not any(given[1] for _, given in found.values()):  # nothing to cut (no row found a copy): not priced
        return dict.fromkeys(found, 0)
    policy = next(iter(found.values()))[0]
    if policy.ragged and len(rows) > 1:  # rows not in `found` score their own tokens (fixed γ, forced)
        alphas = [found[j][0].alphas([found[j][1]])[0] if j in found else (0.0, 0) for j in range(len(rows))]
        base = [1 + forced if j in found else 1 + (len(p) if p is not None else 0)  # tokens scored anyway
                for j, (p, forced, _, _) in enumerate(proposals)]
        left = [row.max_new_tokens - row.produced for row in rows] if until_last else None
        widths = policy.ragged_widths(alphas, base, left)
        return {j: widths[j] for j in found}
    members = {}  # id(policy) -> (policy, row indices, their (match, available, kind))
    for j, (row_policy, row) in found.items():
        _, indices, given = members.setdefault(id(row_policy), (row_policy, [], []))
        indices.append(j)
        given.append(row)
    widths = {}
    for policy, indices, given in members.values():
        width = policy.choose(given, len(rows))
        widths.update((j, width) for j in indices)
    return widths
