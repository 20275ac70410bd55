"""Exact-law tests of auto γ and the auto drafter: the loop's law is the target's while γ and the drafter
are chosen online, per iteration, by the real policies (autogamma/policy.py `AutoGamma`,
drafters/auto.py `AutoDrafter`).

How the enumeration follows state learned online. Auto γ's acceptance posteriors and probe counter,
and the auto drafter's bandit (its counts and its seeded Thompson draws), change with every outcome,
so the γ and the drafter of an iteration depend on the path taken so far. Each `run` builds them
fresh, and `exact_law.enumerate_law` replays every path from scratch: the state a path sees is the one
its own history built (state carried per branch, by construction). The enumerator also checks that
each replay reaches the same choice points, which catches state leaking from one replay to the next.

What makes the choices reproducible. The cost models are frozen (T(k) injected, never refined by wall
time), T(k) depends on the context depth (a row is priced at len(context)), and the auto drafter's
per-arm draft cost is read from a fake clock (`fake_clock`). So γ moves with the depth reached and with
the acceptance history, and each test asserts, from the enumerated law of the γ actually used per
iteration, that it took several values, 0 included, within the enumerated tokens.

Why this may be exact, and what would not be. γ (and the drafter) may depend on anything decided
before the drafts are drawn (history, depth, the other rows of the batch): the verifier's output law
is the target's for every γ, so a γ chosen from the past changes no law. A copy (prompt lookup, the
store) is cut after it is looked up, by its match length: still a function of the context, because a
copy is a point mass. A SAMPLED draft cut by something read off the drafted tokens themselves is not:
keeping x_i only when x_i looks good biases the law (tests/speculative/test_mutants.py plants that bug).

Tolerances as in test_exact_law: point-mass drafts to 1e-12, sampled drafts to 1e-7.
"""

from __future__ import annotations

import itertools
import types
from collections import defaultdict
from collections.abc import Callable

import pytest

from exactspec.drafters import auto as auto_module
from exactspec.drafters.auto import AutoDrafter, DraftBandit
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter, SuffixDrafter
from exactspec.drafters.suffix_index import SuffixIndex
from exactspec.autogamma.acceptance import COPY_PRIOR, Acceptance
from exactspec.autogamma.policy import AutoGamma
from exactspec.autogamma.costs import CostModel
from exactspec.speculative.loop import decode_rows
from exactspec.speculative.rows import Row
from exactspec.speculative.sampling import SamplingParams

from ..helpers.exact_law import TableLM, enumerate_law, product, target_law
from ..helpers.law_checks import POINT_TOL, SAMPLED_TOL, check
from ..helpers.law_checks import Traced, depth_policy, traced_run

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = [1e-3] * 4  # the bandit's T(k): flat, speculation pays whenever anything is accepted


def split(law: dict) -> tuple[dict, dict]:
    """The law of (tokens, trace) -> its two marginals."""
    tokens, traces = defaultdict(float), defaultdict(float)
    for (out, trace), p in law.items():
        tokens[out] += p
        traces[trace] += p
    return dict(tokens), dict(traces)


def used(traces: dict, at: Callable[[tuple], object] = lambda step: step[1]) -> dict[object, float]:
    """P(some iteration has at(step)) for each value: by default, the probability each γ is used."""
    out = defaultdict(float)
    for trace, p in traces.items():
        for value in {at(step) for step in trace}:
            out[value] += p
    return dict(out)


def gammas_by_depth(traces: dict) -> dict[int, set[int]]:
    """Depth -> the γ chosen there on some path."""
    out = defaultdict(set)
    for trace in traces:
        for depth, gamma, _ in trace:
            out[depth].add(gamma)
    return dict(out)


@pytest.fixture
def fake_clock(monkeypatch):
    """The auto drafter times each arm's proposal (its cost per token, which the bandit ranks by): a
    clock that ticks 1/8192 s per reading (exact in binary: every two readings differ by the same
    float) makes that cost 1/8192 s per proposal, the same in every replay."""
    ticks = itertools.count()
    monkeypatch.setattr(auto_module, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) / 8192))


# --- auto γ -----------------------------------------------------------------------------------------

def test_auto_gamma_with_a_draft_model():
    """γ before drafting (`AutoGamma.next_gamma`): 2 at the prompt, then 1 or 0 as the context deepens,
    whichever the acceptances so far say, and probes of γ 1 after plain steps."""
    vocab, n, prompt = 2, 4, [0, 1, 1, 0, 1]
    target, draft = TableLM(0, vocab, 1.0), TableLM(1, vocab, 0.8)
    params = SamplingParams()
    make = lambda: (ModelDrafter(draft), depth_policy(len(prompt)))
    law, traces = split(enumerate_law(traced_run(target, make, prompt, params, n))[0])
    check(law, target_law(target, prompt, n, params=params), SAMPLED_TOL)
    assert set(used(traces)) == {0, 1, 2} and used(traces)[0] > 0.2
    deep = len(prompt) + 2
    assert gammas_by_depth(traces)[deep] == {0, 1}, "at one depth, γ should follow the acceptance history"
    assert any(trace[-2:] == ((deep, 0, None), (deep + 1, 1, "model")) for trace in traces), "no probe"


def test_auto_gamma_cuts_prompt_lookup_copies():
    """Copies are cut after the lookup (`AutoGamma.choose` on their match length and the history of
    that match length's acceptances): point masses, so exact to float64 rounding. Every token of the
    prompt is followed by another, so every context has a copy: a γ of 0 is auto γ's choice."""
    vocab, n, prompt = 3, 4, [0, 1, 2, 1]
    target = TableLM(0, vocab, 1.0)
    params = SamplingParams(temperature=0.9)
    make = lambda: (PromptLookupDrafter(), depth_policy(len(prompt), copies=True))
    law, traces = split(enumerate_law(traced_run(target, make, prompt, params, n))[0])
    check(law, target_law(target, prompt, n, params=params), POINT_TOL)
    assert {0, 1, 2} <= set(used(traces)) and used(traces)[0] > 0.1


def test_auto_gamma_shared_by_a_batch_couples_no_rows():
    """Two rows share one policy: one γ per iteration for both, priced by the batched T(2, k) (γ 0 or
    a probe of 1), learning from both rows' outcomes; once a row leaves, the other is priced alone
    (γ 2). So a row's γ depends on the other row's draws, and still the joint law is the product of
    the rows' target laws."""
    vocab, n = 2, 2
    target = TableLM(0, vocab, 1.0)
    prompts, params = [[0, 1, 1], [1, 0]], [SamplingParams(), SamplingParams(temperature=0.7)]

    def run() -> tuple:
        policy = AutoGamma(CostModel([1.0, 1.0, 1.0, 1.6], frozen=True), first_probe=1)
        rows = [Row(j, prompt, ModelDrafter(TableLM(5, vocab, 1.5)), p, policy, 16, None, Traced())
                for j, (prompt, p) in enumerate(zip(prompts, params))]
        out = {row.key: [] for row in rows}
        for row, tokens in decode_rows(target, rows):
            out[row.key] += tokens
            row.cancelled = len(out[row.key]) >= n
        return tuple(tuple(out[row.key][:n]) for row in rows), tuple(row.stats.trace(len(row.prompt)) for row in rows)

    law, traces = split(enumerate_law(run)[0])
    check(law, product(*(target_law(target, prompt, n, params=p) for prompt, p in zip(prompts, params))),
          2 * SAMPLED_TOL)
    per_row = {trace for pair in traces for trace in pair}
    assert {gamma for trace in per_row for _, gamma, _ in trace} == {0, 1, 2}


# --- the auto drafter -------------------------------------------------------------------------------

def auto_arms(vocab: int, draft: TableLM) -> dict:
    """The arms `Drafting.make("auto")` gives an engine with a store and a draft model: prompt lookup,
    the store (a fresh one: it copies what this request writes to it), bigram, the draft model."""
    return {"prompt-lookup": PromptLookupDrafter(), "store": SuffixDrafter(SuffixIndex(1.0), own_context=False),
            "bigram": NGramDrafter(vocab), "model": ModelDrafter(draft)}


@pytest.mark.usefixtures("fake_clock")
def test_auto_drafter_under_a_fixed_gamma():
    """The bandit's Thompson-sampled ranking picks the arm per iteration, from this request's outcomes."""
    vocab, n, prompt = 2, 4, [0, 1]
    target, draft = TableLM(0, vocab, 1.0), TableLM(1, vocab, 0.8)
    params = SamplingParams()
    make = lambda: (AutoDrafter(DraftBandit(FLAT), auto_arms(vocab, draft)), 2)
    law, traces = split(enumerate_law(traced_run(target, make, prompt, params, n))[0])
    check(law, target_law(target, prompt, n, params=params), SAMPLED_TOL)
    assert set(used(traces, lambda step: step[2])) == {"prompt-lookup", "store", "bigram", "model"}


@pytest.mark.usefixtures("fake_clock")
def test_auto_drafter_under_auto_gamma():
    """Copies priced first (by auto γ's α for their source and match length), the model arms at the
    width auto γ gives them when no copy pays, then the proposal cut by auto γ."""
    vocab, n, prompt = 3, 3, [0, 1]
    target, draft = TableLM(0, vocab, 1.0), TableLM(1, vocab, 0.8)
    params = SamplingParams()

    def make() -> tuple:
        policy = depth_policy(len(prompt), copies=True)
        # the store priced as the context is (its own prior is lower): it wins where its match is longer
        policy.acceptance.keyed[("store", "sampled")] = Acceptance(copy_prior=COPY_PRIOR)
        return AutoDrafter(DraftBandit(FLAT), auto_arms(vocab, draft), policy), policy

    law, traces = split(enumerate_law(traced_run(target, make, prompt, params, n))[0])
    check(law, target_law(target, prompt, n, params=params), SAMPLED_TOL)
    assert set(used(traces, lambda step: step[2])) == {"prompt-lookup", "store", "bigram", "model", None}
    assert set(used(traces)) == {0, 1, 2}
