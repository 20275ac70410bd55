"""Batched rows on the llama.cpp backend (one sequence per row, one llama_decode per iteration): the
adapter's row operations against fresh evaluations, greedy and seeded rows identical to the same rows
decoded alone where the load-time self-test found a row's logits independent of its neighbours, and
Monte-Carlo exactness of sampled rows decoded as one batch (with a negative control)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import need

need("llama_cpp")

from exactspec.drafters.ngram import NGramDrafter  # noqa: E402
from exactspec.drafters.suffix import PromptLookupDrafter  # noqa: E402
from exactspec.embedded import embedded_model_path  # noqa: E402
from exactspec.engine import llamacpp_engine  # noqa: E402
from exactspec.errors import ExactSpecError  # noqa: E402
from exactspec.models.llamacpp.adapter import LlamaCppLM, load_llama_cpp  # noqa: E402
from exactspec.autogamma.policy import AutoGamma  # noqa: E402
from exactspec.speculative.loop import decode_batch  # noqa: E402
from exactspec.speculative.sampling import SamplingParams  # noqa: E402
from exactspec.speculative.verify import verify  # noqa: E402

from ..conftest import TINY_VOCAB, prefix_cached, tiny_llama  # noqa: E402
from ..helpers.laws import CONTROL_SAMPLES, LENGTH, PROMPT, SAMPLES, always_accept, chi_square_p  # noqa: E402
from ..helpers.llama_cpp import backend_law, write_tiny_gguf  # noqa: E402

ROWS = 4
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers, then explain why they are prime.",
           "Rename the variable x to count in: x = 0\nfor i in range(3):\n    x += i\nprint(x)",
           "Name a colour.", "What is the capital of France? Answer in one sentence.",
           # last, and sure to copy whatever setting the self-test chose: auto γ prices the batch's end on it
           "Copy this text exactly: the cat sat on the mat, the dog sat on the log, the cat sat on the mat."]


@pytest.fixture(scope="module")
def engine():
    """The embedded GGUF on llama.cpp with a context for ROWS rows (self-tested at load)."""
    return llamacpp_engine(embedded_model_path(), n_ctx=1024, threads=2, rows=ROWS)


@pytest.fixture(scope="module")
def lm():
    """A bare ROWS-row adapter (q8_0 K cache, n_batch 16: a forward of 4 rows x 9 tokens takes 3 calls)."""
    return load_llama_cpp(embedded_model_path(), n_ctx=512, threads=2, rows=ROWS, n_batch=16, n_ubatch=16,
                          type_k=8, type_v=1)


def batched_or_skip(engine) -> None:
    if not engine.target.batched:
        pytest.skip(f"the self-test keeps this CPU's rows apart: {engine.target.identity}")


def alone(lm: LlamaCppLM, ids: list[int], feed: list[int]) -> torch.Tensor:
    """Logits [k, V] of `feed` after `ids`, evaluated on a fresh one-row cache."""
    lm.reset(1)
    lm.prefill(torch.tensor([ids]))
    return lm.forward(torch.tensor([feed]))[0]


# --- the adapter's row operations ------------------------------------------------------------------
def three_rows(lm: LlamaCppLM) -> list[list[int]]:
    """A cache of three rows holding prompts of 55, 30 and 83 tokens -> the prompts."""
    prompts = [list(range(5, 60)), list(range(100, 130)), list(range(7, 90))]
    lm.reset(0)
    for p in prompts:
        lm.append_rows(p + [1])
    return prompts


def test_rows_are_sequences_with_their_own_lengths(lm):
    """Rows of uneven lengths advance together (27 tokens: 3 llama_decode calls of n_batch 16), roll back
    by different amounts and advance again: each row as if it had been evaluated alone."""
    prompts = [list(range(5, 60)), list(range(100, 130)), list(range(7, 90))]
    lm.reset(0)
    for p in prompts:
        assert lm.append_rows(p + [1]) == 0
    assert lm.batch_size == 3 and lm.batched and lm.max_rows == ROWS
    feed = [[11, 12, 13, 14, 15, 16, 17, 18, 19]] * 3  # [3, 9]
    together = lm.forward_rows(torch.tensor(feed))  # [3, 9, V]
    assert together.shape == (3, 9, lm.vocab_size)
    keep = [2, 0, 9]
    lm.truncate_rows([len(p) + k for p, k in zip(prompts, keep)])
    step = lm.forward_rows(torch.tensor([[3], [4], [5]]))  # [3, 1, V]
    for b, p in enumerate(prompts):  # tolerance: whatever the kernels, a wrong row is off by whole units
        torch.testing.assert_close(together[b], alone(lm, p, feed[b]), atol=1e-3, rtol=0)
        torch.testing.assert_close(step[b], alone(lm, p + feed[b][:keep[b]], [3 + b]), atol=1e-3, rtol=0)


def test_ragged_rows_score_their_own_tokens_only(lm):
    """Rows of 20, 1 and 5 new tokens in one forward (columns of 16 // 3 = 5: 4 llama_decode calls, the
    later ones without the short rows): each row's logits as alone, zero past its own tokens, and each
    row's length advanced by its own count (a step after a rollback lands where it would alone)."""
    prompts = three_rows(lm)
    feed = [list(range(11, 31)), [3], [40, 41, 42, 43, 44]]
    out = lm.forward_ragged(feed)  # [3, 20, V]
    assert out.shape == (3, 20, lm.vocab_size) and not out[1, 1:].any() and not out[2, 5:].any()
    lm.truncate_rows([len(p) + k for p, k in zip(prompts, (20, 1, 2))])
    step = lm.forward_ragged([[7], [8, 9], [10]])
    for b, p in enumerate(prompts):
        torch.testing.assert_close(out[b, :len(feed[b])], alone(lm, p, feed[b]), atol=1e-3, rtol=0)
        kept = p + feed[b][:(20, 1, 2)[b]]
        torch.testing.assert_close(step[b, :(1, 2, 1)[b]], alone(lm, kept, [[7], [8, 9], [10]][b]), atol=1e-3, rtol=0)


def test_ragged_argmax_is_read_in_place_from_the_same_logits(lm):
    """The batched greedy path (`forward_ragged_argmax`, no [B, k, V] array): over the same uneven rows
    and llama_decode calls, each row's argmax is that of the logits `forward_ragged` returns."""
    prompts = three_rows(lm)
    feed = [list(range(11, 31)), [3], [40, 41, 42, 43, 44]]
    out = lm.forward_ragged(feed)  # [3, 20, V]
    lm.truncate_rows([len(p) for p in prompts])
    assert lm.forward_ragged_argmax(feed) == [out[b, :len(f)].argmax(-1).tolist() for b, f in enumerate(feed)]
    after = lm.forward_ragged([[7], [8], [9]])  # each row advanced by its own count
    for b, (p, f) in enumerate(zip(prompts, feed)):
        torch.testing.assert_close(after[b], alone(lm, p + f, [7 + b]), atol=1e-3, rtol=0)


def test_prompts_of_different_lengths_prefill_unpadded(lm):
    """The loop's prefill of different prompts on this adapter: one forward_ragged without logits, each
    row only its own tokens (55, 30 and 83 over calls of 16 // 3 = 5 columns); every row then scores as
    if prefilled alone."""
    prompts = [list(range(5, 60)), list(range(100, 130)), list(range(7, 90))]
    lm.reset(len(prompts))
    assert lm.forward_ragged(prompts, logits=False) is None
    step = lm.forward_ragged([[7], [8, 9], [10]])
    for b, p in enumerate(prompts):
        torch.testing.assert_close(step[b, :(1, 2, 1)[b]], alone(lm, p, [[7], [8, 9], [10]][b]), atol=1e-3, rtol=0)


def test_select_rows_moves_repeats_and_drops_rows(lm):
    prompts = [list(range(5, 40)), list(range(50, 61)), list(range(70, 100))]
    lm.reset(0)
    for p in prompts:
        lm.append_rows(p + [1])
    lm.select_rows(torch.tensor([2, 0, 2]))  # move row 2 to 0, row 0 to 1, repeat row 2; row 1 gone
    assert lm.batch_size == 3
    out = lm.forward_rows(torch.tensor([[9, 8], [9, 8], [9, 8]]))
    for b, src in enumerate([2, 0, 2]):
        torch.testing.assert_close(out[b], alone(lm, prompts[src], [9, 8]), atol=1e-3, rtol=0)
    lm.reset(0)
    lm.append_rows(prompts[0] + [1], copies=ROWS)  # n samples: one prefill, copied
    out = lm.forward_rows(torch.tensor([[9]] * ROWS))
    assert all(torch.equal(out[0], out[b]) for b in range(ROWS))
    lm.select_rows(torch.tensor([1]))
    assert lm.batch_size == 1 and lm.length == len(prompts[0]) + 1


def test_save_and_restore_cache_keep_every_row(lm):
    lm.reset(0)
    lm.append_rows(list(range(5, 30)))
    lm.append_rows(list(range(40, 52)))
    before = lm.forward_rows(torch.tensor([[3], [4]]))
    lm.truncate_rows([24, 11])
    saved = lm.save_cache()
    lm.reset(1)
    lm.prefill(torch.tensor([list(range(200, 260))]))  # the context used for something else
    lm.restore_cache(saved)
    assert lm.batch_size == 2
    assert torch.equal(lm.forward_rows(torch.tensor([[3], [4]])), before)


def test_capacity_and_bad_rows_are_clear_errors(lm):
    lm.reset(0)
    lm.append_rows(list(range(5, 20)), copies=ROWS)
    with pytest.raises(ExactSpecError, match=f"holds {ROWS} rows"):
        lm.append_rows(list(range(5, 20)))
    assert lm.batch_size == ROWS  # the running rows are untouched
    with pytest.raises(ExactSpecError, match="cannot join"):
        lm.append_rows(list(range(lm.max_length + 1)))
    with pytest.raises(ValueError, match="rows for a cache"):
        lm.forward_rows(torch.tensor([[1]]))
    one = load_llama_cpp(embedded_model_path(), n_ctx=256, threads=2)
    assert not one.batched
    with pytest.raises(ExactSpecError, match="one sequence"):
        one.append_rows([1, 2, 3], copies=2)


# --- the loop on batched rows ------------------------------------------------------------------------
def test_rows_that_depend_on_their_neighbours_decode_one_at_a_time(monkeypatch):
    """Where the batched-rows self-test finds a row's logits moved by its neighbours, the context keeps
    its rows apart (not batched) and its identity says why."""
    from exactspec.models.llamacpp import numerics as llama_cpp_numerics

    real = llama_cpp_numerics.cached_check
    monkeypatch.setattr(llama_cpp_numerics, "cached_check",
                        lambda key, name, check: 0.25 if name == "rows-ragged" else real(key, name, check))
    lm = llama_cpp_numerics.load_self_tested(embedded_model_path(), n_ctx=1024, threads=2, rows=2)  # the verdict the
    # other llama.cpp tests share (cached)
    assert lm.max_rows == 2 and not lm.batched and not lm.ragged
    assert "one at a time" in lm.identity and "0.25" in lm.identity


@pytest.mark.parametrize("gamma", [4, "auto"])  # 4: every row 4 drafts; auto: a γ per row (unpadded rows)
def test_greedy_rows_equal_rows_alone(engine, gamma, monkeypatch):
    """More prompts than rows: rows leave and join between iterations (continuous batching). Each row's
    plain decoding alone is the reference (our own greedy identity on one row is test_llama_cpp's).
    Auto γ prices a row's drafts by its own tokens while prompts wait for a row's place, and by what
    they save the batch (the tokens each row has left) once none does; an iteration where no row found a
    copy is not priced."""
    batched_or_skip(engine)
    asked, found, real = [], [], AutoGamma.ragged_widths
    monkeypatch.setattr(AutoGamma, "ragged_widths", lambda self, alphas, base, left=None: asked.append(left)
                        or found.append(max(avail for _, avail in alphas)) or real(self, alphas, base, left))
    together, stats = engine.generate_batch(PROMPTS, max_new_tokens=32, temperature=0, gamma=gamma)
    if gamma == "auto":
        assert None in asked and asked[-1] is not None and 0 < min(asked[-1]) <= max(asked[-1]) <= 32, asked
        assert min(found) > 0, found
    assert stats.target_calls < sum(len(r.token_ids) for r in together)  # rows shared forwards
    for prompt, row in zip(PROMPTS, together):
        assert row.token_ids == engine.generate(prompt, max_new_tokens=32, temperature=0, gamma=0).token_ids


def test_seeded_samples_equal_the_same_seeds_alone(engine):
    """n samples of one prompt share its prefill; sample j with seed s + j is the lone request's with it."""
    batched_or_skip(engine)
    kwargs = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, gamma=4)
    together, _ = engine.generate_batch(PROMPTS[0], n=ROWS + 2, seed=7, **kwargs)
    assert len({tuple(r.token_ids) for r in together}) > 1
    for j, row in enumerate(together):
        assert row.token_ids == engine.generate(PROMPTS[0], seed=7 + j, **kwargs).token_ids


def test_prefix_cache_serves_every_row(engine):
    batched_or_skip(engine)
    shared = "You are a careful assistant. Answer briefly and precisely. " * 6
    prompts = [shared + q for q in ("Name a fruit.", "Name a tree.", "Name a river.")]
    plain, _ = engine.generate_batch(prompts, max_new_tokens=16, temperature=0)
    with prefix_cached(engine):
        engine.generate(prompts[0], max_new_tokens=4, temperature=0)  # the shared prefix is now cached
        cached, _ = engine.generate_batch(prompts, max_new_tokens=16, temperature=0)
        assert all(r.stats.cached_tokens > 20 for r in cached)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]


# --- Monte-Carlo exactness of sampled rows decoded together ------------------------------------------
@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory):
    """The tiny random Llama of conftest as a GGUF, in a context of 16 rows."""
    path = write_tiny_gguf(tiny_llama(0), tmp_path_factory.mktemp("gguf") / "target.gguf")
    return LlamaCppLM(path, threads=1, eos_token_ids=set(), rows=16)


def batched_counts(target, make, params, gamma, samples, verifier=verify) -> torch.Tensor:
    """Counts of each continuation of PROMPT over `samples` rows decoded 16 at a time (own generators)."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(TINY_VOCAB**LENGTH)
    for start in range(0, samples, 16):
        n = min(16, samples - start)
        gens = [torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen))) for _ in range(n)]
        out: dict[int, list[int]] = {}
        for row, tokens in decode_batch(target, [make() for _ in range(n)], [PROMPT] * n, params, gamma, LENGTH,
                                        gens, verifier=verifier):
            out.setdefault(row, []).extend(tokens)
        for tokens in out.values():
            counts[sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(tokens))] += 1
    return counts


@pytest.mark.parametrize("make,params", [
    (lambda: NGramDrafter(TINY_VOCAB, 2), SamplingParams(temperature=1.0, min_p=0.05)),
    (PromptLookupDrafter, SamplingParams(temperature=0.8, top_k=6)),
], ids=["bigram", "prompt-lookup"])
def test_batched_samples_follow_backend_law(tiny_rows, make, params):
    law = backend_law(tiny_rows, params)
    counts = batched_counts(tiny_rows, make, params, 2, SAMPLES)
    assert chi_square_p(counts, law) > 1e-3


def test_batched_negative_control_is_detected(tiny_rows):
    params = SamplingParams(temperature=1.0)
    law = backend_law(tiny_rows, params)
    counts = batched_counts(tiny_rows, lambda: NGramDrafter(TINY_VOCAB, 2), params, 2, CONTROL_SAMPLES,
                            verifier=always_accept)
    assert chi_square_p(counts, law) < 1e-6
