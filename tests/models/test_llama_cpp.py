"""The llama.cpp backend: greedy identity against llama.cpp's own generation, rollback = fresh evaluation,
and Monte-Carlo exactness on a tiny GGUF written here (its exact law enumerated from llama.cpp's logits)."""

from __future__ import annotations

import os

import pytest
import torch

from ..conftest import need

llama_cpp = need("llama_cpp")

from exactspec.bench.llamacpp import llamacpp_generate, llamacpp_methods, prompt_lookup_llama  # noqa: E402
from exactspec.bench.workloads import load_workload  # noqa: E402
from exactspec.drafters.model import ModelDrafter  # noqa: E402
from exactspec.drafters.ngram import NGramDrafter  # noqa: E402
from exactspec.drafters.suffix import PromptLookupDrafter  # noqa: E402
from exactspec.embedded import embedded_model_path  # noqa: E402
from exactspec.errors import ExactSpecError  # noqa: E402
from exactspec.models.llamacpp.adapter import LlamaCppLM, load_llama_cpp  # noqa: E402
from exactspec.autogamma.policy import AutoGamma  # noqa: E402
from exactspec.speculative.loop import decode  # noqa: E402
from exactspec.speculative.sampling import SamplingParams  # noqa: E402
from exactspec.stats import Stats  # noqa: E402

from ..conftest import TINY_VOCAB, prefix_cached, tiny_llama  # noqa: E402
from ..helpers.laws import CONTROL_SAMPLES, PROMPT, always_accept, chi_square_p, sample_counts  # noqa: E402
from ..helpers.prompts import REAL_PROMPTS  # noqa: E402
from ..helpers.costs import q41_cost  # noqa: E402
from ..helpers.llama_cpp import backend_law, write_tiny_gguf

GREEDY = SamplingParams(temperature=0)
N_NEW = 40
# real prompts: the short ones of test_greedy and two long grounded ones (74 and 99 tokens with the chat
# template: a prefill in one ubatch of 64+ tokens would take llama.cpp's other attention kernel)
PROMPTS = REAL_PROMPTS + load_workload("grounded")[:2]


@pytest.fixture
def engine(embedded_llamacpp):
    return embedded_llamacpp  # loaded once for the session (conftest)


def reference(engine, ids, n=N_NEW):
    """llama.cpp's own greedy generation (Llama.generate on the same context) -- or, where our TILED
    PREFILL computes part of the prompt otherwise than Llama.generate does (a prompt of a tile or more),
    our own plain decoding."""
    generated = llamacpp_generate(engine.target.llama, ids, GREEDY, n, 0, engine.target.eos_token_ids)
    if engine.target.prefill_tile and len(ids) > engine.target.prefill_tile:
        return ours(engine, ids, 0, "none", n=len(generated))
    return generated


def ours(engine, ids, gamma, draft, n=N_NEW, stats=None):
    return list(engine.stream_ids(ids, GREEDY, n, gamma, 0, stats, draft))


# --- greedy identity on the embedded GGUF ------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"prompt{i}" for i in range(len(PROMPTS))])
def test_greedy_identity_prompt_lookup(engine, prompt):
    ids = engine.encode(prompt)
    ref = reference(engine, ids, 64 if len(ids) > 64 else N_NEW)
    assert len(ref) > 0
    assert ours(engine, ids, 0, "none", n=len(ref)) == ref, "our plain decoding != llama.cpp's generate"
    with prefix_cached(engine):  # the first run prefills, the others continue from its KV: each vs llama.cpp's own
        for gamma in range(1, 7):
            stats = Stats()
            assert ours(engine, ids, gamma, "prompt-lookup", n=len(ref), stats=stats) == ref, f"gamma={gamma}"
            assert stats.target_calls > 0
        assert stats.cached_tokens == len(ids) - 1


@pytest.mark.parametrize("prompt", REAL_PROMPTS[:2], ids=["prompt0", "prompt1"])
def test_greedy_identity_bigram(engine, prompt):
    ids = engine.encode(prompt)
    ref = reference(engine, ids, 24)
    for gamma in range(1, 7):
        stats = Stats()
        assert ours(engine, ids, gamma, "bigram", n=24, stats=stats) == ref, f"gamma={gamma}"
        assert stats.proposed > 0


def test_greedy_identity_auto_gamma(engine):
    ids = engine.encode(REAL_PROMPTS[1])
    assert ours(engine, ids, "auto", "prompt-lookup") == reference(engine, ids)


def test_suffix_drafter_on_llama_cpp(engine):
    """The suffix drafter on this backend: greedy identity, a repeated request copies the first one's
    answer from the store (fewer calls), and a seeded sample is plain decoding's at any γ."""
    ids = engine.encode(REAL_PROMPTS[0])
    ref = reference(engine, ids)
    first, again = Stats(), Stats()
    assert ours(engine, ids, 4, "suffix", stats=first) == ref
    assert ours(engine, ids, 4, "suffix", stats=again) == ref and again.target_calls < first.target_calls
    assert ours(engine, ids, "auto", "suffix") == ref
    hot = SamplingParams(temperature=0.9, top_p=0.95)
    plain = list(engine.stream_ids(ids, hot, 16, 0, 3, None, "none"))
    assert all(list(engine.stream_ids(ids, hot, 16, g, 3, None, "suffix")) == plain for g in (4, "auto"))


def test_llama_cpp_prompt_lookup_anchor_is_greedy_identical(engine):
    """The llamacpp-prompt-lookup bench row decodes the same tokens (so its speed is comparable)."""
    ids = engine.encode(load_workload("grounded")[0])
    llama = prompt_lookup_llama(engine.target)
    ref = llamacpp_generate(engine.target.llama, ids, GREEDY, 64, 0, engine.target.eos_token_ids)
    assert llamacpp_generate(llama, ids, GREEDY, 64, 0, engine.target.eos_token_ids) == ref
    methods = llamacpp_methods(engine, prompt_lookup=False)
    out, seconds, stats = methods[0].run(ids, GREEDY, 8, 0)
    assert methods[0].method == "llamacpp-plain" and out == ref[:8] and seconds > 0 and stats is None
    defaults = methods[1]  # llama.cpp's own context defaults: its text may differ from ours (another cache type)
    out, seconds, _ = defaults.run(ids, GREEDY, 8, 0)
    assert defaults.method == "llamacpp-defaults" and len(out) == 8 and seconds > 0


def test_tokenizer_agrees_with_llama_cpp(engine):
    """The HF tokenizer read from the GGUF and llama.cpp's own tokenizer give the same ids."""
    llama = engine.target.llama
    for prompt in REAL_PROMPTS + load_workload("grounded") + load_workload("chat"):
        chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                    add_generation_prompt=True)
        for text in (prompt, chat):
            assert engine.tokenizer.encode(text, add_special_tokens=False) == llama.tokenize(
                text.encode(), add_bos=False, special=True)
        assert engine.encode(prompt, chat_template=False) == llama.tokenize(prompt.encode(), special=True)


def test_adapter_properties(engine):
    lm = engine.target
    assert lm.vocab_size == llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(lm.llama.model))
    assert lm.vocab_size == len(engine.tokenizer.get_vocab())
    assert engine.tokenizer.eos_token_id in lm.eos_token_ids
    assert lm.max_length == 1024


# --- rollback ----------------------------------------------------------------------------------------
def test_rollback_equals_fresh_evaluation(engine):
    lm = engine.target
    a = engine.encode(REAL_PROMPTS[0])
    x, y = a[3:9], a[10:14]  # 6 tokens to forget, then 4 others
    lm.reset()
    whole = lm.forward(torch.tensor([a]))
    assert whole.shape == (1, len(a), lm.vocab_size) and whole.dtype == torch.float32 and lm.length == len(a)
    lm.forward(torch.tensor([x]))
    assert lm.length == len(a) + len(x)
    lm.truncate(len(a))
    got = lm.forward(torch.tensor([y]))
    lm.reset()
    fresh = lm.forward(torch.tensor([a + y]))
    torch.testing.assert_close(got, fresh[:, len(a):], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(whole, fresh[:, : len(a)], atol=1e-3, rtol=1e-4)
    # roll back deep into the prompt, several times, with one-token and multi-token feeds
    for cut in (len(a) - 7, 1, len(a) - 1):
        lm.truncate(cut)
        assert lm.length == cut
        part = lm.forward(torch.tensor([a[cut:cut + 1]]))
        rest = lm.forward(torch.tensor([a[cut + 1:] + y]))
        torch.testing.assert_close(torch.cat([part, rest], 1), fresh[:, cut:], atol=1e-3, rtol=1e-4)
    lm.reset()
    assert lm.length == 0


def test_batch_split_does_not_change_logits(engine):
    """What greedy identity rests on (the self-tested cache and n_ubatch): one-token steps, γ+1-token
    verification calls and a one-call forward give bitwise-equal logits, and so does a prefill followed
    by a block -- unless TILED PREFILL computed the prefill's whole tiles with the tiled kernel."""
    lm = engine.target
    ids = engine.encode(load_workload("grounded")[0])
    assert len(ids) > 64

    def run(chunks):
        lm.reset()
        out, i = [], 0
        for c in chunks:
            out.append(lm.forward(torch.tensor([ids[i:i + c]])))
            i += c
        return torch.cat(out, 1)

    singles = run([1] * len(ids))
    assert torch.equal(run([len(ids)]), singles)
    assert torch.equal(run([len(ids) - 20] + [5] * 4), singles)
    lm.reset()
    lm.prefill(torch.tensor([ids[:-20]]))  # the logit-free prefill leaves the same cache
    assert lm.length == len(ids) - 20
    if not lm.prefill_tile:
        assert torch.equal(lm.forward(torch.tensor([ids[-20:]])), singles[:, -20:])
    lm.reset()


def test_adapter_errors(engine, tmp_path):
    lm = engine.target
    lm.reset()
    lm.forward(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError):
        lm.truncate(4)
    with pytest.raises(ExactSpecError, match="exceeds"):
        lm.forward(torch.zeros((1, lm.max_length), dtype=torch.long))
    assert lm.length == 3
    lm.reset()
    with pytest.raises(ExactSpecError, match="not found"):
        load_llama_cpp(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ExactSpecError, match="bad magic"):
        load_llama_cpp(str(bad))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(embedded_model_path(), "rb").read(4096))
    with pytest.raises(ExactSpecError, match="llama.cpp cannot load"):
        load_llama_cpp(str(truncated))


# --- statistical exactness on a tiny GGUF ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_modules():
    return tiny_llama(0), tiny_llama(1, sharpness=4.0, layers=1)  # the same weights as conftest's tiny pair


@pytest.fixture(scope="module")
def tiny_pair(tiny_modules, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    target, draft = (write_tiny_gguf(m, folder / f"{name}.gguf") for m, name in zip(tiny_modules, ("target", "draft")))
    return (LlamaCppLM(target, threads=1, eos_token_ids=set()), LlamaCppLM(draft, threads=1, eos_token_ids=set()))


def test_tiny_gguf_matches_transformers(tiny_pair, tiny_modules):
    """The GGUF written above is the same model as the transformers one (f16 KV cache: loose tolerance)."""
    ids = PROMPT + [1, 7, 0, 6]
    for lm, module in zip(tiny_pair, tiny_modules):
        assert lm.vocab_size == TINY_VOCAB and lm.max_length == module.config.max_position_embeddings
        lm.reset()
        ours_logits = lm.forward(torch.tensor([ids]))
        with torch.no_grad():
            theirs = module(input_ids=torch.tensor([ids])).logits
        torch.testing.assert_close(ours_logits, theirs, atol=2e-2, rtol=1e-2)
        lm.reset()


DEEP = 300  # past patch 10's first chunk of keys (EXACTSPEC_FA_KEYS 256): its rescale between chunks runs


def test_grouped_heads_match_transformers(tmp_path):
    """SmolLM2's attention shape (9 query heads of 64 on 3 K/V heads), f16 cache, 2 threads: the passes the
    seventh llama.cpp patch runs with a group's heads in lockstep (scripts/llama_cpp_patches/05-query-heads-of-a-kv-head-in-lockstep.patch,
    on AVX-512 in chunks of keys: 10-per-row-attention-in-chunks-of-keys.patch; a
    lone token's 9 rows split 3+2 | 1+3 between the threads, a block's in whole groups) give transformers'
    logits DEEP tokens deep, past the first chunk of 256 keys, and so does the DEEP-token pass before them
    (the tiled kernel, with the eighth patch's vectorized mask, K rows and maxima). Builds with a planted
    bug failed it: the K/V head of a 2-head run one off (1.7% of the logits off, by up to 7.9), a masked
    key shown in the tiled kernel (31%); in patch 10's chunks, the softmax's sum not rescaled where a later
    chunk's largest score grew (3.2% off, by up to 5.0), and a chunk's last 16 keys left out of that sum
    (2.5%). Those two passed this test 150 tokens deep (one chunk), and the self-test called them bit-exact:
    steps and blocks were wrong alike."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=48, hidden_size=576, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    module = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharp attention whose output moves the logits: a key too many or too few shows
        module.lm_head.weight.mul_(8.0)
        for layer in module.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(6.0)
            for proj in (layer.self_attn.v_proj, layer.self_attn.o_proj):
                proj.weight.mul_(4.0)
    lm = LlamaCppLM(write_tiny_gguf(module, tmp_path / "gqa.gguf"), threads=2, eos_token_ids=set(), n_ubatch=512,
                    type_k=1, type_v=1)  # n_ubatch 512: the DEEP-token pass is one, tiled
    ids = torch.randint(3, 48, (1, DEEP + 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = module(input_ids=ids).logits  # [1, DEEP + 20, 48]
    lm.reset()
    ours = [lm.forward(ids[:, :DEEP])]
    for start, end in ((0, 1), (1, 2), (2, 7), (7, 15), (15, 16), (16, 20)):
        ours.append(lm.forward(ids[:, DEEP + start:DEEP + end]))
    ours = torch.cat(ours, 1)
    assert theirs[0, DEEP:].std() > 0.5  # logits that tell heads apart
    torch.testing.assert_close(ours, theirs, atol=0.1, rtol=2e-2)  # f16 cache, sharp attention: up to ~0.02 here


@pytest.mark.parametrize("drafter,params,gamma", [
    ("model", SamplingParams(temperature=1.0), 2),
    ("model", SamplingParams(temperature=0.8, top_k=5, top_p=0.9), 3),
    ("bigram", SamplingParams(temperature=1.0, min_p=0.05), 2),
    ("prompt-lookup", SamplingParams(temperature=1.0), 2),
])
def test_speculative_samples_follow_backend_law(tiny_pair, drafter, params, gamma):
    target, draft = tiny_pair
    make = {"model": lambda: ModelDrafter(draft), "bigram": lambda: NGramDrafter(TINY_VOCAB, 2),
            "prompt-lookup": PromptLookupDrafter}[drafter]
    law = backend_law(target, params)
    counts = sample_counts(target, make, params, gamma)
    p = chi_square_p(counts, law)
    tv = 0.5 * (counts / counts.sum() - law).abs().sum()
    assert p > 1e-3, f"chi-square p={p:.2e}, TV={tv:.3f}"


def test_negative_control_always_accept_is_detected(tiny_pair):
    """The same check on a planted always-accept verifier fails: the test has power on this backend."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0)
    law = backend_law(target, params)
    counts = sample_counts(target, lambda: ModelDrafter(draft), params, 2, verifier=always_accept,
                           samples=CONTROL_SAMPLES)  # p = 1e-93 at this count (test_exactness: why it suffices)
    assert chi_square_p(counts, law) < 1e-6


def test_constrained_greedy_identity(engine):
    """A JSON schema on the llama.cpp backend: forced-only and forced + prompt lookup == constrained plain,
    the output parses, and forced tokens were proposed."""
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    runs = [engine.generate("Alice is 30. Return her as JSON.", max_new_tokens=40, temperature=0, gamma=g, draft=d,
                            response_format=fmt) for g, d in [(0, "none"), (4, "none"), (4, "prompt-lookup")]]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert runs[0].finish_reason == "stop" and set(json.loads(runs[0].text)) == {"name", "age"}
    assert runs[1].stats.forced > 0


def test_greedy_identity_long_proposals(engine):
    """An edit prompt: proposals of up to 32 tokens (γ+1 = 33 stays in flash attention's invariant
    ubatches) and auto decode llama.cpp's own greedy tokens, with long accepted runs."""
    ids = engine.encode(load_workload("edit")[1])
    ref = reference(engine, ids, 80)
    # auto on this machine's own T(k) (identity), and on llama.cpp Q4_1's T(k) frozen (long runs: the
    # γ it picks must not depend on how busy the machine is while the test measures)
    with prefix_cached(engine):
        for gamma in (16, 32, "auto", "auto on Q4_1's T(k)"):
            stats = Stats()
            if gamma == "auto on Q4_1's T(k)":
                out = list(decode(engine.target, PromptLookupDrafter(), ids, GREEDY, AutoGamma(q41_cost()), len(ref),
                                  None, stats))
            else:
                out = ours(engine, ids, gamma, "prompt-lookup", n=len(ref), stats=stats)
            assert out == ref, f"gamma={gamma}"
            if gamma != "auto":
                assert max(i for i, n in enumerate(stats.run_lengths) if n) >= 8, (gamma, stats.run_lengths)
        assert stats.cached_tokens == len(ids) - 1


def test_one_token_steps_equal_blocks_past_the_thread_split(engine):
    """Whatever this CPU is: under the setting the load-time self-test chose (llamacpp/numerics.py), blocks
    of 8 and 70 tokens scored at a 300- and a 600-token context equal the same tokens scored one at a
    time, bit for bit, or the engine says greedy identity rests on tolerance. (With llama.cpp's default f16
    cache, two threads split one-token attention past ~256 tokens: 0.6-1.1 off, greedy choices flipped.)"""
    from exactspec.models.llamacpp.numerics import BLOCK, LONG, WIDE, block_vs_steps

    lm = engine.target
    identity = engine.runtime()["greedy_identity"]
    ids = torch.randint(0, lm.vocab_size, (600 + LONG,), generator=torch.Generator().manual_seed(3)).tolist()
    diffs = [block_vs_steps(lm, ids[: c + LONG], c, (BLOCK, WIDE, LONG))[0] for c in (300, 600)]
    if "bit-exact" in identity:
        assert diffs == [0.0] * 2, (identity, diffs)
    else:
        assert "tolerance" in identity, identity


def test_block_vs_steps_sees_a_planted_difference(engine, monkeypatch):
    """Negative control of the self-test's comparison: blocks that score 2^-20 off are seen, whichever
    of the block sizes drifts."""
    from exactspec.models.llamacpp.numerics import BLOCK, block_vs_steps

    lm, real, blocks = engine.target, engine.target.forward, (3, BLOCK)
    ids = torch.randint(0, lm.vocab_size, (40 + BLOCK,), generator=torch.Generator().manual_seed(4)).tolist()
    for drifting in blocks:
        monkeypatch.setattr(lm, "forward", lambda new_ids: real(new_ids) + 2.0 ** -20 * (new_ids.shape[1] == drifting))
        assert block_vs_steps(lm, ids, 40, blocks)[0] > 0, drifting
    monkeypatch.undo()
    assert block_vs_steps(lm, ids, 40, blocks)[0] == 0.0 or "tolerance" in engine.runtime()["greedy_identity"]


def test_the_self_test_keeps_the_fastest_bit_equal_setting():
    """`pick`, on made-up trials: inexact settings never win; the fastest exact one does, unless an earlier
    one is within 3%; nothing exact -> the first setting, said to rest on tolerance."""
    from exactspec.models.llamacpp.numerics import CANDIDATES, Setting, pick

    q8, bf16, f16_bare, f16, one = CANDIDATES
    f16_one = Setting("f16", "f16", 1, 512, 64)  # tiles with one-thread steps (not a candidate: pick ranks any)
    fast = 1e9  # prefill tokens/s too fast to matter: the steps decide
    assert pick([(f16, 0.8, 10.0, fast), (bf16, 0.0, 12.0, fast), (q8, 0.0, 11.0, fast), (one, 0.0, 14.0, fast)]).setting == q8
    assert pick([(f16, 0.0, 10.2, fast), (bf16, 0.0, 10.0, fast)]).setting == f16  # within 3%: the earlier one
    assert pick([(f16, 0.0, 11.0, fast), (bf16, 0.0, 10.0, fast)]).setting == bf16
    # slower steps, but a prefill fast enough to win the ranked request (PROMPT tokens, STEPS steps)
    assert pick([(f16, 0.0, 11.0, 250.0), (q8, 0.0, 10.0, 150.0)]).setting == f16
    assert pick([(f16, 0.0, 17.0, 300.0), (f16_one, 0.0, 13.0, 300.0), (q8, 0.0, 9.0, 150.0)]).setting == f16_one
    assert pick([(f16, 0.0, 15.0, 300.0), (q8, 0.0, 10.0, 220.0)]).setting == q8  # a session is mostly steps
    none = pick([(f16, 0.5, 10.0, fast), (bf16, 0.25, 9.0, fast)])
    assert (none.setting, none.exact, none.max_diff) == (f16, False, 0.5)
    assert "tolerance" in none.describe(2) and "bit-exact" in pick([(one, 0.0, 9.0, fast)]).describe(2)


def test_one_slow_timing_does_not_pick_the_cache_type(monkeypatch):
    """`_measure_verdict` on made-up trials: the tiled f16 setting, measured first, is timed slow once (the
    first pass after a load, a neighbour's burst: what made a Zen 4 keep the q8_0 cache, half the prefill,
    ~15% slower plain serving); the finalists are timed again in reverse order and each ranked by its better
    timing, so the tiled one wins as its steady timings say. A single bit-exact setting is not timed again."""
    from exactspec.models.llamacpp import numerics

    q8, bf16, bare, padded, one = numerics.CANDIDATES
    steady = {q8: (9.2, 185.0), bf16: (11.5, 160.0), bare: (10.8, 320.0), one: (17.5, 240.0)}
    timed = []

    def trial(setting, beat_ms):
        step_ms, prefill = steady[setting]
        if not timed:  # the first timing of the process: a third slower
            step_ms, prefill = step_ms * 1.35, prefill / 1.35
        timed.append(setting)
        return 0.0, step_ms, prefill

    monkeypatch.setattr(numerics, "trial", trial)
    assert numerics.request_ms(10.8 * 1.35, 320 / 1.35) > numerics.request_ms(9.2, 185.0)  # one round picks q8_0
    verdict = numerics._measure_verdict(lambda setting: setting, 2)
    assert verdict.setting == bare and verdict.exact and timed.count(bare) == 2
    timed.clear()
    steady = {bare: (10.8, 320.0)}
    monkeypatch.setattr(numerics, "CANDIDATES", (bare,))
    monkeypatch.setattr(numerics, "MEASURED_ORDER", (bare,))
    assert numerics._measure_verdict(lambda setting: setting, 2).setting == bare and timed == [bare]


@pytest.mark.parametrize("bare_diff", [0.0, 0.7])
def test_a_padded_setting_is_tried_only_where_its_unpadded_twin_is_inexact(monkeypatch, bare_diff):
    """`_measure_verdict` on made-up trials: the padded tiled candidate costs a pad on top of the same
    kernels, so it is measured only where the unpadded one (bit-exact on make setup's llama.cpp build,
    scripts/build_llama_cpp.py) is not."""
    from exactspec.models.llamacpp import numerics

    tried = []

    def trial(setting, beat_ms):
        tried.append(setting)
        return (bare_diff if setting.prefill_tile and not setting.pad else 0.0), 10.0, 200.0

    monkeypatch.setattr(numerics, "trial", trial)
    verdict = numerics._measure_verdict(lambda setting: setting, 2)
    padded = [c for c in numerics.CANDIDATES if c.prefill_tile and c.pad]
    assert padded and all((c in tried) == (bare_diff != 0.0) for c in padded)
    assert verdict.setting == numerics.CANDIDATES[0] and verdict.exact  # all tied: the first


def test_a_setting_sure_to_lose_stops_after_half_its_prefill_and_the_order_of_preference_holds(monkeypatch):
    """`_measure_verdict` on adapters that only advance a clock: the tiled settings are measured first; one
    whose first prefill piece already prices the ranked request above FAVOUR times a bit-exact setting's
    is not timed further. The pick still prefers an earlier candidate within FAVOUR, and an inexact
    setting's speed stops nothing."""
    from types import SimpleNamespace

    from exactspec.models.llamacpp import numerics

    q8, bf16, bare, padded, one = numerics.CANDIDATES
    prefill_s = {q8: 20.0, bf16: 2.1, bare: 2.0, padded: 2.0, one: 3.0}  # a MEASURED-token prefill's seconds
    inexact = set()
    clock = [0.0]
    monkeypatch.setattr(numerics, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(numerics, "prefix_vs_whole", lambda lm, ids: True)

    class Timed:
        max_length, vocab_size = 4096, 100

        def __init__(self, setting):
            self.setting = setting

        def reset(self):
            pass

        def truncate(self, n):
            pass

        def prefill(self, ids):  # [1, n]
            clock[0] += prefill_s[self.setting] * ids.shape[1] / numerics.MEASURED

        def forward(self, ids):  # [1, n] -> [1, n, V]: 10 ms a token
            clock[0] += 0.01 * ids.shape[1]
            noise = torch.rand(1, ids.shape[1], 1) if self.setting in inexact else 0.0
            return torch.zeros(1, ids.shape[1], self.vocab_size) + noise

    timed = []

    def trial(lm, beat_ms):
        start = clock[0]
        got = real_trial(lm, beat_ms)
        timed.append((lm.setting, clock[0] - start, got))
        return got

    real_trial = numerics.trial
    monkeypatch.setattr(numerics, "trial", trial)
    verdict = numerics._measure_verdict(Timed, 2)
    # the padded twin is not measured (its bare one is exact); the bit-exact ones are timed again, reversed
    assert [t[0] for t in timed] == [bare, q8, bf16, one, bf16, bare]  # the two fastest, timed again
    (stopped, seconds), = [(setting, seconds) for setting, seconds, got in timed[:4] if got is None]
    assert stopped == q8 and seconds < 0.6 * prefill_s[q8]  # half its prefill and SHALLOW steps
    assert verdict.setting == bf16 and verdict.exact  # within FAVOUR of the tiled one, and earlier

    inexact.update({bare, padded})  # then nothing is stopped before a bit-exact setting is measured
    timed.clear()
    assert numerics._measure_verdict(Timed, 2).setting == bf16
    assert [t[0] for t in timed] == [bare, padded, q8, bf16, one, one, bf16] and all(t[2] for t in timed)


def test_prefill_time_is_extrapolated_from_two_halves():
    """`prefill_seconds`: a token at depth d costing a + b*d is recovered from two consecutive pieces, so a
    setting whose attention grows with depth is ranked at the PROMPT it is ranked by, not at MEASURED."""
    from exactspec.models.llamacpp.numerics import prefill_seconds

    def cost(start, n, a=2e-3, b=1e-6):  # seconds of tokens start..start+n-1
        return sum(a + b * d for d in range(start, start + n))

    pieces = [(512, cost(0, 512)), (512, cost(512, 512))]
    assert prefill_seconds(pieces, 2048) == pytest.approx(cost(0, 2048), rel=1e-9)
    assert prefill_seconds([(100, 1.0)], 300) == pytest.approx(3.0)  # one piece: flat
    flat = [(512, cost(0, 512, b=0)), (512, cost(512, 512, b=0))]
    assert prefill_seconds(flat, 2048) == pytest.approx(cost(0, 2048, b=0), rel=1e-9)


def test_greedy_identity_past_256_tokens(engine):
    """A 300-token prompt (past the point where two threads split one-token attention on some CPUs):
    speculative == plain decoding, token for token, when the engine says it is bit-exact."""
    if "bit-exact" not in engine.runtime()["greedy_identity"]:
        pytest.skip(f"llama.cpp is not bit-exact on this CPU: {engine.runtime()['greedy_identity']}")
    text = " ".join(load_workload("grounded"))
    ids = engine.encode(text)[:300]
    plain = ours(engine, ids, 0, "none", n=24)
    assert ours(engine, ids, "auto", "prompt-lookup", n=24) == plain
    assert ours(engine, ids, 8, "bigram", n=24) == plain


def test_ctx_size_default_and_choice(monkeypatch):
    """--ctx-size: the default is the model's training context where the KV budget holds it, lowered in
    steps of 256 (never below 4096) where it does not; a chosen size is what the engine says it runs."""
    import exactspec
    from exactspec.models.llamacpp import runtime

    path = embedded_model_path()
    train, per_token = runtime._train_context(path), runtime.kv_bytes_per_token(path)
    assert train >= 4096 and per_token > 0
    monkeypatch.setattr(runtime, "_kv_budget", lambda: 10 * train * per_token)
    assert runtime.default_context(path, rows=1) == train and runtime.default_context(path, rows=10) == train
    lowered = runtime.default_context(path, rows=16)  # 10/16 of the training context fits
    assert lowered == max(4096, 10 * train // 16 // 256 * 256) and lowered % 256 == 0 and lowered < train
    monkeypatch.undo()
    engine = exactspec.load(threads=2, ctx_size=1024, gamma=0, draft="none")
    assert engine.backend == "llama.cpp" and engine.target.max_length == 1024
    assert engine.context_line().startswith("context 1024 tokens per row x 1 row (KV cache")
    with pytest.raises(ExactSpecError, match="must be >= 2"):
        exactspec.load(ctx_size=1)


def test_an_amx_cpu_keeps_repacked_weights_with_every_row_on_the_one_row_kernel(monkeypatch):
    """Where the CPU advertises AMX, the AMX buffer's multi-row Q4_1 / Q8_0 products run the one-row VNNI
    kernel (EXACTSPEC_AMX_ROWS=1), so the probe survives and repacking stays on. Elsewhere: repacking on,
    the variable never set."""
    from exactspec.models.llamacpp import runtime

    monkeypatch.delenv("EXACTSPEC_LLAMACPP_REPACK", raising=False)
    monkeypatch.setattr(runtime, "_PROBED", {})
    assert runtime.resolve_repack(embedded_model_path()) is True
    assert (os.environ.get(runtime.AMX_ROWS) == "1") == runtime.cpu_has_amx()  # set at the module's import


SWITCHES = """
import os, sys
if sys.argv[1] == "first":
    import llama_cpp
from exactspec.models.llamacpp import numerics, runtime
before = runtime.kernel_switches()
os.environ[runtime.KQUANT_TILES] = "0"  # too late: the library read it (or will, as it was)
print(before, runtime.kernel_switches(), sep="\\n")
"""


@pytest.mark.parametrize("order", ["ours", "first"])
def test_the_kernel_switches_are_keyed_as_the_library_latched_them(order):
    """The switches are set when the runtime module is imported, before any load, and a verdict's key
    holds them as they were then: a later change to the environment (which the library never reads
    again) changes no key; llama_cpp imported before them (it may have computed under others) is keyed
    `unsure`, so no verdict measured under known switches is served to it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("EXACTSPEC_KQUANT") and not k.startswith("EXACTSPEC_AMX")}
    out = subprocess.run([sys.executable, "-c", SWITCHES, order], capture_output=True, text=True, env=env, timeout=120)
    before, after = out.stdout.split()
    assert before == after and "EXACTSPEC_KQUANT_TILES=1" in before, out.stderr
    assert before.endswith(",unsure") == (order == "first")


def test_a_verdict_is_keyed_by_the_build_it_was_measured_with(monkeypatch):
    """The libraries' bytes (CPU, compiler and flags of the build) are part of the verdict's key."""
    from exactspec.models.llamacpp import numerics, runtime

    one = numerics.key("model", {"n_ctx": 1}, True)
    monkeypatch.setattr(runtime, "build_identity", lambda: "another build")
    assert numerics.key("model", {"n_ctx": 1}, True) != one
    monkeypatch.undo()
    assert runtime.build_identity() and all(len(part) == 12 for part in runtime.build_identity().split(","))


def test_amx_tiles_decode_on_the_patched_build():
    """llama.cpp's own AMX tiles (EXACTSPEC_AMX_ROWS=0: every multi-row product on tiles) decode: a GCC 12
    build dropped the tile configuration's stores and died with SIGILL at the first tile instruction, which
    stock llama-server still does on such CPUs (patch 11). Where the CPU has no AMX, no tile runs at all."""
    from exactspec.models.llamacpp import runtime

    assert runtime._decodes(embedded_model_path(), {**os.environ, runtime.AMX_ROWS: "0"})
