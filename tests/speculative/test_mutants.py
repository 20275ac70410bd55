"""Planted bugs the exact-law tests must catch (docs/exactness-and-lenience.md lists them).

Each mutant is applied by monkeypatching the real function (the verifier the loop's acceptance rule calls,
a drafter's `propose`, the law's warp or penalties); the loop's law is then enumerated exactly
(tests/helpers/exact_law.py) and compared with the target's. Each mutant names how it must be caught: the law
moves by more than 1e-3 (10^4 times the exact tests' tolerance), or the loop stops on a named assertion
(an emitted token breaks the grammar); an exception of any other kind fails the test. Four mutants are EQUIVALENT: they change no law, and the test asserts that they pass, so
the exact-law test raises no false alarm. Exactness needs q reported = q sampled; it does not need q warped
or masked like p (a worse q only lowers acceptance). Nor does it forbid cutting sampled drafts after they
are drawn: only a cut that reads the drafted tokens themselves biases the law (test_exact_law_auto.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.speculative import accept as accept_module
from exactspec.speculative import propose as propose_module
from exactspec.speculative import sampling
from exactspec.speculative import verify as verify_module
from exactspec.speculative.interfaces import CutsCopies, Proposal
from exactspec.speculative.law import Penalties, TargetLaw
from exactspec.speculative.rows import Row
from exactspec.speculative.sampling import SamplingParams, as_numpy, warp

from ..helpers.exact_law import distance, enumerate_law, target_law
from ..helpers.law_checks import PROMPT, TokenGrammar, drafter_factory, first_tokens, grammar_oracle, penalised, target_and_draft
from ..helpers.law_checks import depth_policy, traced_run

pytestmark = pytest.mark.usefixtures("one_thread")

CAUGHT = 1e-3


# --- the mutants ---------------------------------------------------------------------------------------

def verifier(residual: str = "clamped", bonus_from_q: bool = False, reuse_uniform: bool = False):
    """A copy of verify.verify_with_uniforms (exact when called with the defaults) with one bug switched on."""
    def verify_with_uniforms(draft_ids, draft_probs, target_probs, uniforms, lenience=1.0):
        gamma = len(draft_ids)
        p, u = as_numpy(target_probs), as_numpy(uniforms)
        q = None if draft_probs is None else as_numpy(draft_probs)
        n = 0
        while n < gamma:
            x = draft_ids[n]
            accept = u[n] * lenience < p[n, x] if q is None else u[n] * lenience * q[n, x] < p[n, x]
            if not accept:
                break
            n += 1
        law = p[n]
        if n < gamma:
            qn = np.eye(p.shape[1], dtype=p.dtype)[draft_ids[n]] if q is None else q[n]
            law = {"clamped": lambda: np.maximum(p[n] - lenience * qn, 0), "p": lambda: p[n],
                   "unclamped": lambda: p[n] - lenience * qn}[residual]()
            if not law.sum() > 0:
                law = p[n]
        elif bonus_from_q and q is not None:
            law = q[gamma - 1]  # the bonus drawn from the draft's last law
        uniform = u[n] if reuse_uniform and n < gamma else u[gamma]
        return draft_ids[:n] + [verify_module.sample_from_uniform(law, uniform)]
    return verify_with_uniforms


def drafter_reporting(report):
    """A copy of ModelDrafter.propose whose reported law is report(q sampled, logits, params, previous q)."""
    def propose(self, context, k, params, generator, law=None):
        if k <= 0:
            return Proposal.empty()
        logits = self._sync(context)
        ids, probs, previous = [], [], None
        for i in range(k):
            q = warp(logits, params) if law is None else law.draft_probs(logits, context + ids)
            token = sampling.sample(q, generator)
            ids.append(token)
            probs.append(report(q, logits, params, previous))
            previous = q
            if i + 1 < k:
                logits = self.model.forward(torch.tensor([[token]]))[0, -1]
                self.cached.append(token)
        return Proposal(torch.tensor(ids, dtype=torch.long), torch.stack(probs))
    return propose


def penalise_off_by_one(self, x, drafts, offset):
    """TargetLaw._penalise with each draft counted from its own position on (one position early)."""
    pen = self.penalties
    counts, seen = self._counts.clone(), self._seen.clone()
    for t in drafts[:offset]:
        counts[t] += 1
        seen[t] = True
    rows = []
    for j in range(x.shape[0]):
        if offset + j < len(drafts):  # BUG: before the row is penalised, not after
            counts[drafts[offset + j]] += 1
            seen[drafts[offset + j]] = True
        row = x[j]
        if pen.repetition_penalty != 1:
            row = torch.where(seen, torch.where(row > 0, row / pen.repetition_penalty, row * pen.repetition_penalty), row)
        rows.append(row - pen.frequency_penalty * counts - pen.presence_penalty * (counts > 0).float())
    return torch.stack(rows)


def mask_on_draft_only(original):
    def probs(self, logits, drafts, offset=0, record=True):
        if not record:  # a draft model's law (draft_probs): masked
            return original(self, logits, drafts, offset, record)
        matcher, self.matcher = self.matcher, None  # the target's window: unmasked (BUG)
        try:
            return original(self, logits, drafts, offset, record)
        finally:
            self.matcher = matcher
    return probs


def without(*names):
    """accept.warp with some warps dropped: the target's law misses them, the drafts keep them."""
    def warp_target(logits, params):
        return warp(logits, dataclasses.replace(params, **{name: {"top_p": 1.0, "min_p": 0.0, "top_k": 0}[name]
                                                         for name in names}))
    return warp_target


def always_accept(draft_ids, draft_probs, target_probs, uniforms, lenience=1.0):
    return draft_ids + [int(as_numpy(target_probs)[len(draft_ids)].argmax())]


def cut_after_drafting(match_of):
    """Under auto γ, every drafter's proposal is cut after drafting, as a copy's is (`Row.cuts`),
    to auto γ's width for the match length `match_of(proposal)` that the bigram drafter now reports."""
    original, row_init = NGramDrafter.propose, Row.__post_init__

    def propose(self, *args, **kwargs):
        proposal = original(self, *args, **kwargs)
        proposal.match = match_of(proposal)
        return proposal

    def every_row_copies(self):
        row_init(self)
        self.cuts = self.gamma if isinstance(self.gamma, CutsCopies) else None

    def install(mp):
        mp.setattr(Row, "__post_init__", every_row_copies)
        mp.setattr(NGramDrafter, "propose", propose)
    return install


def cut_before(token: int, sampled_too: bool):
    """`propose.before_eos` cutting every proposal before `token` (as if it were EOS, which the loop then
    does not stop on): as it is (copies only), or with its guard gone (sampled drafts cut too)."""
    def cut(proposal, forced, eos):
        if proposal is None or (proposal.probs is not None and not sampled_too):
            return proposal
        ids = proposal.tokens()
        at = next((i for i, t in enumerate(ids) if i >= forced and t == token), None)
        if at is None:
            return proposal
        return Proposal(ids[:at], None if proposal.probs is None else proposal.probs[:at], proposal.match) if at else None
    return lambda mp: mp.setattr(propose_module, "before_eos", cut)


def confident(proposal: Proposal) -> int:
    """How many leading drafts the drafter gave probability >= 1/2: read off the drafted tokens."""
    ids = proposal.tokens()
    return next((i for i, x in enumerate(ids) if proposal.probs[i, x] < 0.5), len(ids))


LAW = "the law moves"  # how a mutant is caught; EQUIVALENT: None (the law must not move)
BROKEN_GRAMMAR = (AssertionError, "break the grammar")  # the loop's own check of what it emitted

# name -> (install(monkeypatch), config, how it is caught)
MUTANTS = {
    "control: the verifier's copy, unmutated": (
        lambda mp: mp.setattr(accept_module, "verify_with_uniforms", verifier()), "model", None),
    "residual = p": (lambda mp: mp.setattr(accept_module, "verify_with_uniforms", verifier(residual="p")), "model", LAW),
    "residual not clamped (p - q)": (
        lambda mp: mp.setattr(accept_module, "verify_with_uniforms", verifier(residual="unclamped")), "model", LAW),
    "bonus token from q": (
        lambda mp: mp.setattr(accept_module, "verify_with_uniforms", verifier(bonus_from_q=True)), "bonus", LAW),
    "uniform reused between accept and residual (vLLM)": (
        lambda mp: mp.setattr(accept_module, "verify_with_uniforms", verifier(reuse_uniform=True)), "model", LAW),
    "always accept": (lambda mp: mp.setattr(accept_module, "verify_with_uniforms", always_accept), "model", LAW),
    "warp on p only: q sampled warped, reported un-warped": (
        lambda mp: mp.setattr(ModelDrafter, "propose", drafter_reporting(
            lambda q, logits, params, prev: logits.float().softmax(-1))), "warped", LAW),
    "q reported != q sampled (the previous position's law)": (
        lambda mp: mp.setattr(ModelDrafter, "propose", drafter_reporting(
            lambda q, logits, params, prev: q if prev is None else prev)), "model", LAW),
    "top-p applied to q only": (lambda mp: mp.setattr(accept_module, "warp", without("top_p")), "top-p", LAW),
    "min-p applied to q only": (lambda mp: mp.setattr(accept_module, "warp", without("min_p")), "min-p", LAW),
    "penalty counts off by one position": (
        lambda mp: mp.setattr(TargetLaw, "_penalise", penalise_off_by_one), "penalties", LAW),
    "grammar mask on the draft only": (
        lambda mp: mp.setattr(TargetLaw, "probs", mask_on_draft_only(TargetLaw.probs)), "grammar", BROKEN_GRAMMAR),
    "γ chosen after seeing the drafts: sampled drafts cut like copies, by how many the drafter was sure of": (
        cut_after_drafting(confident), "auto-bigram", LAW),
    "sampled drafts cut before a drafted end of sequence (before_eos without its point-mass guard)": (
        cut_before(0, sampled_too=True), "model", LAW),
    # equivalent mutants: the law is unchanged, and the exact-law test must say so
    "EQUIVALENT warp on p only: q sampled AND reported un-warped": (
        lambda mp: mp.setattr("exactspec.drafters.model.warp", lambda logits, params: logits.float().softmax(-1)),
        "warped", None),
    "EQUIVALENT grammar mask on the target only: q sampled AND reported unmasked": (
        lambda mp: mp.setattr(TargetLaw, "draft_probs", lambda self, logits, prefix: warp(logits, self.params)),
        "grammar", None),
    "EQUIVALENT sampled drafts cut like copies, by a match blind to their values (their count)": (
        cut_after_drafting(len), "auto-bigram", None),
    "EQUIVALENT copies cut before a drafted end of sequence (before_eos as it is)": (
        cut_before(0, sampled_too=False), "lookup", None),
}


def config(name: str):
    """-> (run, oracle) of the configuration a mutant is checked on (small: tens to hundreds of paths)."""
    vocab = 3
    target, draft = target_and_draft(vocab, sharpness=1.5)
    model = drafter_factory("model", vocab, draft)
    if name == "model":
        params = SamplingParams()
        return first_tokens(target, model, PROMPT, params, 2, 2), target_law(target, PROMPT, 2, params=params)
    if name == "bonus":  # γ = 1, two tokens: the bonus position is within them
        params = SamplingParams()
        return first_tokens(target, model, PROMPT, params, 1, 2), target_law(target, PROMPT, 2, params=params)
    if name in ("warped", "top-p", "min-p"):
        params = {"warped": SamplingParams(temperature=0.7, top_k=2), "top-p": SamplingParams(top_p=0.6),
                  "min-p": SamplingParams(min_p=0.25)}[name]
        return first_tokens(target, model, PROMPT, params, 2, 2), target_law(target, PROMPT, 2, params=params)
    if name == "lookup":  # point-mass copies, three tokens deep
        params = SamplingParams()
        return (first_tokens(target, drafter_factory("prompt-lookup", vocab, draft), PROMPT, params, 3, 3),
                target_law(target, PROMPT, 3, params=params))
    if name == "penalties":
        params, pen = SamplingParams(), Penalties(frequency_penalty=1.5)
        make_law = lambda: TargetLaw(params, PROMPT, vocab, penalties=pen)
        return (first_tokens(target, drafter_factory("prompt-lookup", vocab, draft), PROMPT, params, 3, 3, make_law=make_law),
                target_law(target, PROMPT, 3, law_at=penalised(PROMPT, pen, params, vocab)))
    if name == "grammar":
        params, prompt = SamplingParams(), [2, 1, 2, 0, 1, 2]
        make_law = lambda: TargetLaw(params, prompt, vocab, matcher=TokenGrammar(vocab, prompt[-1]))
        return (first_tokens(target, model, prompt, params, 2, 2, make_law=make_law),
                target_law(target, prompt, 2, law_at=grammar_oracle(vocab, prompt, params)))
    if name == "auto-bigram":  # auto γ over bigram, already at the steep depth: γ 0 unless α looks >= 0.5
        target, _ = target_and_draft(2, sharpness=1.5)
        params, prompt = SamplingParams(), [t % 2 for t in PROMPT]
        run = traced_run(target, lambda: (NGramDrafter(2), depth_policy(len(prompt) - 2)), prompt, params, 2)
        return (lambda: run()[0]), target_law(target, prompt, 2, params=params)
    raise KeyError(name)


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutant_is_caught_by_the_exact_law(monkeypatch, mutant):
    install, name, caught = MUTANTS[mutant]
    run, oracle = config(name)
    install(monkeypatch)
    if isinstance(caught, tuple):  # the loop must stop on that assertion, and on no other exception
        kind, words = caught
        with pytest.raises(kind, match=words):
            enumerate_law(run)
        return
    law, _ = enumerate_law(run)
    gap = distance(law, oracle)
    if caught == LAW:
        assert gap > CAUGHT, f"{mutant}: NOT caught, the law moved by {gap:.2e} only"
    else:
        assert gap < 1e-7, f"{mutant}: should change no law, moved it by {gap:.2e}"
