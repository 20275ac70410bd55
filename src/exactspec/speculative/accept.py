"""Steps 2 and 3 of the loop: what one target forward gave the batch (`Scored`), and the rule by which each
row accepts a prefix of its drafts and one more token (`Rule`, chosen once per row by `acceptance`)."""

from __future__ import annotations

from functools import cached_property

import torch

from .law import TargetLaw
from .rows import Draft, Row
from .sampling import LawError, SamplingParams, bad_laws, warp
from .verify import accept_greedy, accept_greedy_lenient, verify, verify_block_with_uniforms, verify_coupled, \
    verify_with_uniforms
from .verify_torch import verify_rows, verify_rows_coupled


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
    def laws(self) -> tuple[dict[int, int], torch.Tensor | None]:
        """(row -> its index i, laws [R, K+1, V]) for the rows whose rule verifies against target laws:
        each row's law transform (grammar, penalties) where it has one, else the warp of its params.
        Per-row isolation: a row that has failed already is left out; a row whose law transform raises,
        or whose laws are not distributions at its positions (NaN, no mass: `bad_laws`, one host sync
        for all rows), gets `error` set and its laws are not read; the other rows' laws are untouched."""
        rest = [j for j, row in enumerate(self.rows) if row.rule.needs_laws and row.error is None]
        if not rest:
            return {}, None
        logits = self.logits if len(rest) == len(self.rows) else self.logits[rest]  # [R, K+1, V]
        shaped = [i for i, j in enumerate(rest) if self.rows[j].law is not None and not self.rows[j].law.trivial]
        if len(rest) == 1 and shaped:  # one row with a law (a lone generation): its laws as they come
            row, ids = self.rows[rest[0]], self.drafts[rest[0]].ids
            probs = row.law.probs(logits[0, : len(ids) + 1], ids)[None]  # [1, k+1, V]; raises: this row's error
        else:
            if len(shaped) < len(rest):
                probs = _warp_rows(logits, [self.rows[j].params for j in rest])
            else:
                probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            for i in shaped:
                row, ids = self.rows[rest[i]], self.drafts[rest[i]].ids
                try:
                    probs[i, : len(ids) + 1] = row.law.probs(logits[i, : len(ids) + 1], ids)
                except Exception as e:  # a grammar dead end, a broken law: this row alone fails
                    row.error = e
        widths = torch.tensor([len(self.drafts[j].ids) + 1 for j in rest], device=probs.device)
        for i in bad_laws(probs, widths).tolist():
            row = self.rows[rest[i]]
            row.error = row.error or LawError()
        return {j: i for i, j in enumerate(rest)}, probs

    def law(self, j: int) -> torch.Tensor:
        """Row j's target laws [k+1, V]; raises the row's error if its laws failed (not distributions)."""
        index, probs = self.laws
        if self.rows[j].error is not None:
            raise self.rows[j].error
        return probs[index[j], : len(self.drafts[j].ids) + 1]

    @cached_property
    def on_device(self) -> dict[int, list[int]]:
        """Every device-verified row's emitted tokens, from ONE batched tensor verification."""
        index, probs = self.laws
        members = [j for j in index if self.rows[j].rule is ON_DEVICE and self.rows[j].error is None]
        if not members:
            return {}
        laws = probs if len(members) == len(index) else probs[[index[j] for j in members]]  # [D, K+1, V]
        found = verify_on_device([self.rows[j] for j in members], [self.drafts[j] for j in members], laws)
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

    def joint(self, draft: Draft) -> bool:
        """Whether `draft` is verified as a block (Sun et al. 2025) rather than token by token: what a
        row's stats count (`Stats.block_verified`) and the server reports as its `verification`."""
        return False


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
    fastest on a CPU), or an injected verifier (tests) on the laws where they are. Point-mass drafts
    (exact rule) take its coupled form, which leaves a seeded text as plain decoding's (verify_coupled).
    `block`: drafts with a real law are verified jointly (verify_block_with_uniforms); point masses keep
    the coupled token rule."""

    needs_laws = True

    def __init__(self, verifier=verify, lenience: float = 1.0, block: bool = False):
        self.verifier, self.host, self.block = verifier, verifier is verify, block
        self.options = {} if lenience == 1 else {"lenience": lenience}

    def accept(self, scored: Scored, j: int) -> list[int]:
        d, laws, row = scored.drafts[j], scored.law(j), scored.rows[j]
        probs = d.probs[: len(d.ids)] if d.probs is not None else None
        if not self.host:  # an injected verifier draws its own uniforms
            return self.verifier(d.ids, probs, laws, row.generator, **self.options)
        laws, probs = laws.cpu(), None if probs is None else probs.cpu()  # NumPy reads host memory (no copy on the CPU)
        uniforms = row.uniforms.take(len(d.ids) + 1)
        if probs is None and not self.options:  # point masses, exact: plain decoding's tokens (verify_coupled)
            out = verify_coupled(d.ids, laws, uniforms)
            row.uniforms.unread(uniforms[len(out):])
            return out
        if self.joint(d):
            return verify_block_with_uniforms(d.ids, probs, laws, uniforms)
        return verify_with_uniforms(d.ids, probs, laws, uniforms, **self.options)

    def joint(self, draft: Draft) -> bool:
        return self.block and draft.probs is not None  # point masses keep the coupled token rule


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
    block = params.verification == "block"
    if device.type != "cpu" and not lenient and not block:  # block verification runs on the host (NumPy)
        return ON_DEVICE
    return Sampled(verify, params.lenience, block)


def verify_on_device(rows: list[Row], drafts: list[Draft], target_probs: torch.Tensor) -> list[list[int]]:
    """Every row's emitted tokens from batched tensor verification on the laws' device [A, K+1, V]:
    point-mass rows by the coupled rule (verify_torch.verify_rows_coupled), the others by
    verify_torch.verify_rows; each row takes its γ+1 uniforms from its stream (Row.uniforms) and hands
    the unused ones back exactly as the per-row verifier does, so outputs do not change. Only the ids
    come back to the host."""
    A, width = target_probs.shape[:2]
    draft_ids = torch.zeros(A, width - 1, dtype=torch.long)
    uniforms = torch.zeros(A, width)
    gammas = torch.tensor([len(d.ids) for d in drafts], dtype=torch.long)
    coupled = [d.probs is None for d in drafts]  # point masses: verify_coupled's rule, batched
    draft_probs = None if all(coupled) else torch.zeros(A, width - 1, target_probs.shape[-1], device=target_probs.device)
    for j, (row, d) in enumerate(zip(rows, drafts)):
        k = len(d.ids)
        draft_ids[j, :k] = torch.tensor(d.ids, dtype=torch.long)
        uniforms[j, : k + 1] = torch.tensor(row.uniforms.take(k + 1))
        if draft_probs is not None and d.probs is not None:
            draft_probs[j, :k] = d.probs[:k].to(target_probs.device)
    found = [None] * A
    for rule, members in ((verify_rows_coupled, [j for j in range(A) if coupled[j]]),
                          (verify_rows, [j for j in range(A) if not coupled[j]])):
        if not members:
            continue
        m = torch.tensor(members)
        args = (draft_ids[m], gammas[m]) + (() if rule is verify_rows_coupled else (draft_probs[m.to(draft_probs.device)],))
        accepted, nxt = torch.stack(rule(*args, target_probs[m.to(target_probs.device)], uniforms[m])).tolist()
        for i, j in enumerate(members):
            found[j] = drafts[j].ids[: accepted[i]] + [nxt[i]]
            if rule is verify_rows_coupled:  # hand the uniforms of positions not reached back
                rows[j].uniforms.unread(uniforms[j, accepted[i] + 1 : gammas[j] + 1].tolist())
    return found
