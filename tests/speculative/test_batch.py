"""Batched speculative decoding with uneven acceptance: each row is exactly what it would be alone."""

from __future__ import annotations

import pytest
import torch

from exactspec.autogamma.costs import CostModel
from exactspec.autogamma.measure import measure_target
from exactspec.autogamma.policy import AutoGamma
from exactspec.speculative.fixed_gamma import FixedGamma
from exactspec.speculative.loop import decode
from exactspec.speculative.loop import BatchDecoder, Row, decode_batch
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.errors import ExactSpecError
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats

from ..conftest import TINY_VOCAB, tiny_llama
from ..helpers.laws import always_accept, batched_counts, chi_square_p, exact_law
from ..helpers.scripted import Scripted

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[3, 5, 2, 3, 5, 7, 2], [1, 2], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [6]]


@pytest.fixture(scope="module")
def fast_tiny() -> FastLlamaLM:
    return FastLlamaLM(tiny_llama(0), eos_token_ids=set(), capacity=16)


def run_batch(target, drafters, prompts, params, gamma, n, seeds, cancelled=None):
    out = {r: [] for r in range(len(prompts))}
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    for r, tokens in decode_batch(target, drafters, prompts, params, gamma, n, gens, cancelled=cancelled):
        out[r] += tokens
    return [out[r] for r in range(len(prompts))]


def run_alone(target, drafter, prompt, params, gamma, n, seed):
    return list(decode(target, drafter, prompt, params, gamma, n, torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_each_row_greedy_equals_row_alone(fast_tiny, gamma):
    drafters = [PromptLookupDrafter(), NGramDrafter(TINY_VOCAB), Scripted(lambda c: []), None]  # row 2 proposes nothing
    batch = run_batch(fast_tiny, drafters, PROMPTS, GREEDY, gamma, 20, [0, 1, 2, 3])
    alone = [run_alone(fast_tiny, d, p, GREEDY, 0, 20, 0) for d, p in zip([None] * 4, PROMPTS)]
    assert batch == alone


def test_sampled_rows_match_alone_with_same_seeds(fast_tiny):
    params = SamplingParams(temperature=1.0, top_k=6)
    batch = run_batch(fast_tiny, [PromptLookupDrafter() for _ in PROMPTS], PROMPTS, params, 3, 16, [10, 11, 12, 13])
    alone = [run_alone(fast_tiny, PromptLookupDrafter(), p, params, 3, 16, s) for p, s in zip(PROMPTS, [10, 11, 12, 13])]
    assert batch == alone


def test_b1_is_identical_to_unbatched_loop(fast_tiny):
    params = SamplingParams(temperature=0.9)
    batch = run_batch(fast_tiny, [NGramDrafter(TINY_VOCAB)], [PROMPTS[0]], params, 4, 24, [5])
    assert batch[0] == run_alone(fast_tiny, NGramDrafter(TINY_VOCAB), PROMPTS[0], params, 4, 24, 5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lenient_rows_batch_and_match_alone(fast_tiny, temperature):
    """Lenient (lossy) rows go through the same loop: each row of a batch is its lone run, same seed."""
    params = SamplingParams(temperature=temperature, lenience=0.5)
    seeds = [20, 21, 22, 23]
    batch = run_batch(fast_tiny, [NGramDrafter(TINY_VOCAB) for _ in PROMPTS], PROMPTS, params, 3, 12, seeds)
    assert batch == [run_alone(fast_tiny, NGramDrafter(TINY_VOCAB), p, params, 3, 12, s) for p, s in zip(PROMPTS, seeds)]


def test_row_finishing_on_first_token_leaves_the_batch(fast_tiny):
    first = run_alone(fast_tiny, None, PROMPTS[1], GREEDY, 0, 1, 0)[0]
    fast_tiny.eos_token_ids = {first}
    try:
        batch = run_batch(fast_tiny, [PromptLookupDrafter() for _ in PROMPTS], PROMPTS, GREEDY, 4, 12, [0] * 4)
        alone = [run_alone(fast_tiny, None, p, GREEDY, 0, 12, 0) for p in PROMPTS]
    finally:
        fast_tiny.eos_token_ids = set()
    assert batch[1] == [first] and batch == alone


def test_cancelled_row_stops_others_continue(fast_tiny):
    cancelled = {0}
    batch = run_batch(fast_tiny, [None, None], PROMPTS[:2], GREEDY, 0, 10, [0, 0], cancelled)
    assert len(batch[0]) == 1 and len(batch[1]) == 10


def test_batch_stats_count_one_target_call_per_iteration(fast_tiny):
    rows = [Stats() for _ in PROMPTS]
    total = Stats()
    gens = [torch.Generator().manual_seed(0) for _ in PROMPTS]
    list(decode_batch(fast_tiny, [PromptLookupDrafter() for _ in PROMPTS], PROMPTS, GREEDY, 3, 15, gens, rows, total))
    assert total.emitted == 60 == sum(s.emitted for s in rows)
    assert total.target_calls == max(s.target_calls for s in rows)
    assert total.proposed == sum(s.proposed for s in rows)


@pytest.mark.usefixtures("one_thread")
def test_batched_rows_follow_target_law(fast_tiny):
    params = SamplingParams(temperature=1.0)
    law = exact_law(fast_tiny, params)
    assert chi_square_p(batched_counts(fast_tiny, lambda: NGramDrafter(TINY_VOCAB), params, 2, seed=0), law) > 1e-3


@pytest.mark.usefixtures("one_thread")
def test_batched_negative_control(fast_tiny):
    params = SamplingParams(temperature=1.0)
    law = exact_law(fast_tiny, params)
    counts = batched_counts(fast_tiny, lambda: NGramDrafter(TINY_VOCAB), params, 2, verifier=always_accept, seed=0)
    assert chi_square_p(counts, law) < 1e-6


def test_engine_generate_batch_equals_one_by_one(embedded):
    prompts = ["Rewrite in the past tense: I walk to school.", "List three colours."]
    results, stats = embedded.generate_batch(prompts, n=2, max_new_tokens=20, temperature=0, gamma=4)
    assert len(results) == 4 and stats.target_calls < sum(r.stats.target_calls for r in results)
    for i, r in enumerate(results):
        alone = embedded.generate(prompts[i // 2], max_new_tokens=20, temperature=0, gamma=0)
        assert r.token_ids == alone.token_ids and r.text == alone.text


def test_engine_generate_batch_lenient_rows(embedded):
    """Lenient requests batch (one forward for both samples) and say they are not exact."""
    prompt, kw = "List three colours.", dict(max_new_tokens=12, temperature=0.8, lenience=0.5, gamma=3)
    results, stats = embedded.generate_batch(prompt, n=2, seed=3, **kw)
    assert stats.exact is False and stats.target_calls < sum(r.stats.target_calls for r in results)
    for j, r in enumerate(results):
        assert r.token_ids == embedded.generate(prompt, seed=3 + j, **kw).token_ids


def test_engine_generate_batch_stop_string(embedded):
    prompt = "Count from one to ten in words, separated by commas."
    full = embedded.generate(prompt, max_new_tokens=30, temperature=0)
    stop = full.text[10:14]
    results, _ = embedded.generate_batch(prompt, n=2, max_new_tokens=30, temperature=0, stop=[stop])
    for r in results:
        assert r.finish_reason == "stop" and stop not in r.text and full.text.startswith(r.text)


# --- continuous batching: rows join a running batch between iterations --------------------------
LONG_PROMPT = [(3 * i + 1) % TINY_VOCAB for i in range(45)]  # longer than the cache's 16 positions


def run_joining(target, schedule: list[tuple[int, Row]], on_step=None) -> dict:
    """Decode with rows joining at the given iteration numbers; returns each row's tokens by key."""
    decoder, out, step = BatchDecoder(target), {row.key: [] for _, row in schedule}, 0
    while decoder.rows or any(at >= step for at, _ in schedule):
        joining = [row for at, row in schedule if at == step]
        if joining:
            decoder.add(joining)
        if on_step:
            on_step(decoder, step)
        if decoder.rows:
            for row, tokens in decoder.step():
                out[row.key] += tokens
        step += 1
    return out


def greedy_row(key, prompt, drafter, gamma, n=20):
    return Row(key, prompt, drafter, GREEDY, FixedGamma(gamma), n, torch.Generator().manual_seed(0))


def test_rows_joining_mid_flight_equal_rows_alone(fast_tiny):
    fast_tiny.reset()  # whatever the cache held before
    schedule = [(0, greedy_row("a", PROMPTS[0], PromptLookupDrafter(), 3)),
                (2, greedy_row("b", PROMPTS[3], NGramDrafter(TINY_VOCAB), 5)),  # a one-token prompt
                (2, greedy_row("c", LONG_PROMPT, PromptLookupDrafter(), 2, n=30)),  # the cache must grow
                (5, greedy_row("d", PROMPTS[2], None, 0)),
                (40, greedy_row("e", PROMPTS[1], PromptLookupDrafter(), 4))]  # after the batch emptied
    out = run_joining(fast_tiny, schedule)
    for _, row in schedule:
        assert out[row.key] == run_alone(fast_tiny, None, row.prompt, GREEDY, 0, row.max_new_tokens, 0), row.key


def test_rows_with_their_own_params_and_gamma_match_alone(fast_tiny):
    """Rows with different sampling parameters, γ and seeds share one batch; each is exactly its lone run
    with the same seed. Two samples of one prompt join together (one prefill). The auto row is greedy:
    auto prices a batched iteration by T(B, k), so its γ (hence which uniforms a sampled row draws)
    depends on the batch by design; its greedy output does not."""
    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4, 1.5], frozen=True)  # the same γ choices in both runs
    specs = [("t1k6", SamplingParams(temperature=1.0, top_k=6), 3, PROMPTS[0], 0),
             ("t07p9", SamplingParams(temperature=0.7, top_p=0.9), 1, PROMPTS[2], 1),
             ("auto", GREEDY, "auto", PROMPTS[1], 1),
             ("greedy", GREEDY, 4, LONG_PROMPT, 3),
             ("copy1", SamplingParams(temperature=0.9), 2, PROMPTS[3], 3),
             ("copy2", SamplingParams(temperature=0.9), 2, PROMPTS[3], 3)]

    def gamma_of(g):
        return AutoGamma(cost, 0.5) if g == "auto" else FixedGamma(g)

    schedule = [(at, Row(key, prompt, PromptLookupDrafter(), params, gamma_of(g), 16,
                         torch.Generator().manual_seed(100 + i)))
                for i, (key, params, g, prompt, at) in enumerate(specs)]
    out = run_joining(fast_tiny, schedule)
    for i, (key, params, g, prompt, _) in enumerate(specs):
        assert out[key] == run_alone(fast_tiny, PromptLookupDrafter(), prompt, params, gamma_of(g), 16, 100 + i), key
    assert out["copy1"] != out["copy2"]  # different seeds: the shared prefill did not tie them


def test_failed_join_leaves_the_running_rows_intact(fast_tiny, monkeypatch):
    real = fast_tiny.forward_rows
    calls = []

    def fail_second_prefill(ids, logits=True):
        if ids.shape[0] == 1 and ids.shape[1] > 1:  # a prefill
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected prefill failure")
        return real(ids, logits)

    monkeypatch.setattr(fast_tiny, "forward_rows", fail_second_prefill)
    decoder, out = BatchDecoder(fast_tiny), {"a": [], "b": []}
    decoder.add([greedy_row("a", PROMPTS[0], PromptLookupDrafter(), 3), greedy_row("b", PROMPTS[2], None, 0)])
    for _ in range(2):
        for row, tokens in decoder.step():
            out[row.key] += tokens
    with pytest.raises(RuntimeError, match="injected"):  # the 2nd new row fails after the 1st joined
        decoder.add([greedy_row("c", PROMPTS[1], None, 0), greedy_row("d", LONG_PROMPT, None, 0)])
    with pytest.raises(ExactSpecError, match="empty"):
        decoder.add([greedy_row("e", [], None, 0)])
    assert [row.key for row in decoder.rows] == ["a", "b"] and fast_tiny.batch_size == 2
    while decoder.rows:
        for row, tokens in decoder.step():
            out[row.key] += tokens
    for key, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[2])):
        assert out[key] == run_alone(fast_tiny, None, prompt, GREEDY, 0, 20, 0)


def test_lending_the_target_keeps_the_batch(fast_tiny):
    """Measuring the target's speed (it resets the cache) between iterations does not disturb the batch."""
    def measure(decoder, step):
        if step == 3:
            with decoder.lend() as target:
                measure_target(target, max_k=2, context=10, reps=1)

    schedule = [(0, greedy_row("a", PROMPTS[0], PromptLookupDrafter(), 3)), (1, greedy_row("b", PROMPTS[2], None, 0))]
    out = run_joining(fast_tiny, schedule, measure)
    for _, row in schedule:
        assert out[row.key] == run_alone(fast_tiny, None, row.prompt, GREEDY, 0, 20, 0)


def test_join_prefill_equals_a_lone_prefill(fast_tiny):
    """A joined row's cache is its lone prefill: its next logits are those of a batch of one."""
    fast_tiny.reset(1)
    fast_tiny.forward_rows(torch.tensor([PROMPTS[2][:-1]]))
    alone = fast_tiny.forward_rows(torch.tensor([[PROMPTS[2][-1]]]))
    fast_tiny.reset(0)
    fast_tiny.append_rows(PROMPTS[0])
    fast_tiny.append_rows(PROMPTS[2], copies=2)
    fast_tiny.append_rows(PROMPTS[3])
    assert fast_tiny.lengths.tolist() == [len(PROMPTS[0]) - 1, len(PROMPTS[2]) - 1, len(PROMPTS[2]) - 1, 0]
    last = torch.tensor([[p[-1]] for p in (PROMPTS[0], PROMPTS[2], PROMPTS[2], PROMPTS[3])])
    logits = fast_tiny.forward_rows(last)
    assert torch.allclose(logits[1:3], alone.expand(2, -1, -1), atol=1e-5)
    fast_tiny.select_rows(torch.tensor([3, 1]))  # in place: the survivors move into the holes
    assert fast_tiny.lengths.tolist() == [1, len(PROMPTS[2])]
    with pytest.raises(ExactSpecError):
        fast_tiny.append_rows(list(range(fast_tiny.max_length)))
    assert fast_tiny.batch_size == 2


def test_device_rule_equals_host_rule(fast_tiny, tiny_draft, monkeypatch):
    """The GPU's rule (every sampled row verified in ONE batched tensor op, verify_torch.py), run here on
    the CPU, gives each row the tokens of the per-row NumPy verifier: same uniforms, same rule. Rows with
    point-mass and with model drafts share the op (the former get one-hot draft laws)."""
    import exactspec.speculative.loop as loop
    from exactspec.drafters.model import ModelDrafter
    from exactspec.speculative.accept import ON_DEVICE

    params = SamplingParams(temperature=1.0, top_k=6)

    def drafters():
        return [PromptLookupDrafter(), ModelDrafter(tiny_draft), None, NGramDrafter(TINY_VOCAB)]

    host = run_batch(fast_tiny, drafters(), PROMPTS, params, 3, 16, [10, 11, 12, 13])
    real = loop.acceptance
    monkeypatch.setattr(loop, "acceptance", lambda p, law, verifier, device: real(p, law, verifier, torch.device("cuda")))
    assert loop.acceptance(params, None, None, torch.device("cpu")) is ON_DEVICE
    assert run_batch(fast_tiny, drafters(), PROMPTS, params, 3, 16, [10, 11, 12, 13]) == host


@pytest.mark.parametrize("device_rule", [False, True])
def test_point_mass_drafts_leave_sampled_text_as_plain_decoding(fast_tiny, monkeypatch, device_rule):
    """At T > 0 a row with point-mass drafts (prompt lookup, a store, grammar-forced tokens) emits, for a
    seed, exactly the tokens plain decoding samples from that seed: each position's token comes from that
    position's uniform (verify_coupled, Uniforms), whatever γ, batch or rule (host or device)."""
    import exactspec.speculative.loop as loop

    if device_rule:
        real = loop.acceptance
        monkeypatch.setattr(loop, "acceptance", lambda p, law, verifier, device: real(p, law, verifier, torch.device("cuda")))
    params = SamplingParams(temperature=1.0, top_p=0.95)
    seeds = [21, 22, 23, 24]
    plain = run_batch(fast_tiny, [None] * 4, PROMPTS, params, 0, 24, seeds)
    for gamma in (1, 4, 12):
        assert run_batch(fast_tiny, [PromptLookupDrafter() for _ in PROMPTS], PROMPTS, params, gamma, 24, seeds) == plain
    alone = [run_alone(fast_tiny, PromptLookupDrafter(), p, params, 4, 24, s) for p, s in zip(PROMPTS, seeds)]
    assert alone == plain
    accepted = Stats()
    list(decode(fast_tiny, PromptLookupDrafter(), PROMPTS[2], params, 4, 24, torch.Generator().manual_seed(24), accepted))
    assert accepted.accepted > 0  # drafts were accepted, not all rejected


def test_engine_seeded_sampling_is_plain_text_under_any_gamma(embedded):
    """A seed fixes a sampled text: with prompt lookup it is plain decoding's at γ 4, 16 and auto (the
    README's promise for `seed`)."""
    prompt = "Rewrite in the past tense: I walk to school and I see my friends. We play football."
    runs = {g: embedded.generate(prompt, max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7, gamma=g).token_ids
            for g in (0, 4, 16, "auto")}
    assert runs[4] == runs[0] and runs[16] == runs[0] and runs["auto"] == runs[0]


def test_a_drafter_reads_its_prompt_when_its_row_joins(fast_tiny, monkeypatch):
    """`ReadsPrompt`: a row's drafter indexes its prompt at the row's set-up, before the prefill, so the first
    step, right after the prefill, does not; a drafter whose read fails fails its own row alone."""
    events = []

    class Reading(PromptLookupDrafter):
        def read_prompt(self, prompt):
            events.append(("read", list(prompt)))
            super().read_prompt(prompt)

    class Failing(PromptLookupDrafter):
        def read_prompt(self, prompt):
            raise RuntimeError("injected read failure")

    real = fast_tiny.forward_rows
    monkeypatch.setattr(fast_tiny, "forward_rows", lambda ids, logits=True: events.append("pass") or real(ids, logits))
    decoder, out = BatchDecoder(fast_tiny), {"a": [], "b": []}
    decoder.add([greedy_row("a", PROMPTS[0], Reading(), 3), greedy_row("b", PROMPTS[2], Failing(), 3)])
    assert events[0] == ("read", PROMPTS[0]) and "pass" in events[1:]  # read before its prefill
    failed = {}
    while decoder.rows:
        for row, tokens in decoder.step():
            out[row.key] += tokens
            if row.error is not None:
                failed[row.key] = str(row.error)
    assert failed == {"b": "injected read failure"} and out["b"] == []
    assert out["a"] == run_alone(fast_tiny, None, PROMPTS[0], GREEDY, 0, 20, 0)
    assert [e for e in events if e != "pass"] == [("read", PROMPTS[0])]  # read once
