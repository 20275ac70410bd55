"""Encoder-decoder targets and drafts (T5, BART) on tiny random models built here: greedy identity with
plain decoding and transformers `generate`, the sampled law of 3-token continuations (with a negative
control), rollback that keeps the cross-attention cache, one encoder run per request, and the one-line
refusals of bad pairs; then the whole path a user takes (saved directories + tokenizer -> load ->
CLI and server)."""

from __future__ import annotations

import itertools
import json

import openai
import pytest
import torch

from exactspec.speculative.loop import decode
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.drafters.source import WithSource
from exactspec.errors import ExactSpecError
from exactspec.models.seq2seq import Seq2SeqLM
from exactspec.speculative.sampling import SamplingParams, warp

from ..conftest import TINY_VOCAB, tiny_llama
from ..helpers.cli import assert_one_line_error, exactspec
from ..helpers.laws import always_accept, chi_square_p

pytestmark = pytest.mark.usefixtures("one_thread")

SOURCE = [3, 5, 2, 3, 5, 4, 6, 1]  # ends in EOS (1), as a tokenizer's source does
LENGTH, SAMPLES = 3, 1200
WORDS = ["<pad>", "</s>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran"]  # the saved models' vocabulary


def _sharpen(model: torch.nn.Module, scale: float, gain: float = 2.0) -> torch.nn.Module:
    """Random weights of `gain` x unit scale and a head of `scale`: next-token laws far from uniform
    (transformers' T5/BART init is tiny, and its tiny random models repeat one token)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, gain * p.shape[1] ** -0.5)
        model.get_output_embeddings().weight.mul_(scale / gain)
    return model.eval()


def tiny_t5(seed: int, layers: int = 2, vocab: int = TINY_VOCAB, scale: float = 3.0) -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                      decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return _sharpen(T5ForConditionalGeneration(config), scale)


def tiny_bart(seed: int, layers: int = 2, vocab: int = TINY_VOCAB, scale: float = 3.0) -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(vocab_size=vocab, d_model=32, encoder_layers=layers, decoder_layers=layers,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=64, decoder_start_token_id=2, bos_token_id=0, eos_token_id=1,
                        pad_token_id=0, forced_bos_token_id=None, forced_eos_token_id=None, tie_word_embeddings=False)
    return _sharpen(BartForConditionalGeneration(config), scale, gain=1.0)


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """(target, smaller draft) per family, sharing the vocabulary."""
    return {"t5": (tiny_t5(13, layers=1), tiny_t5(3, layers=1, scale=2.0)),  # seeds whose greedy paths vary
            "bart": (tiny_bart(5), tiny_bart(1, layers=1, scale=2.0))}


def run(target, drafter, params, gamma, n, generator=None, stop_on_eos=True) -> list[int]:
    return list(decode(target, drafter, target.decoder_prompt, params, gamma, n, generator, stop_on_eos=stop_on_eos))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_greedy_equals_plain_and_generate(pairs, family):
    module, draft_module = pairs[family]
    target, draft = Seq2SeqLM(module), Seq2SeqLM(draft_module)
    greedy = SamplingParams(temperature=0)
    target.set_source(SOURCE)
    plain = run(target, None, greedy, 0, 16)
    with torch.no_grad():
        hf = module.generate(torch.tensor([SOURCE]), max_new_tokens=16, do_sample=False)[0].tolist()
    assert hf[len(target.decoder_prompt):] == plain
    assert len(set(plain)) > 2, "the tiny model's greedy path is degenerate: the test would prove little"
    for gamma in range(1, 7):
        draft.set_source(SOURCE)
        assert run(target, ModelDrafter(draft), greedy, gamma, 16) == plain, gamma
        lookup = WithSource(PromptLookupDrafter(), SOURCE, len(target.decoder_prompt), target.eos_token_ids)
        assert run(target, lookup, greedy, gamma, 16) == plain, gamma


def continuation_law(module, params: SamplingParams, start: list[int]) -> torch.Tensor:
    """[V**LENGTH] probability of every decoder continuation under the warped target, by enumeration."""
    seqs = torch.tensor(list(itertools.product(range(TINY_VOCAB), repeat=LENGTH)))  # [N, L]
    dec = torch.cat([torch.tensor(start).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = module(input_ids=torch.tensor([SOURCE]).expand(len(seqs), -1), decoder_input_ids=dec).logits
    probs = warp(logits[:, len(start) - 1 : -1], params)  # [N, L, V]
    return probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1)


def continuation_counts(target, make_drafter, params, gamma, verifier=None, samples=SAMPLES) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(TINY_VOCAB**LENGTH)
    target.set_source(SOURCE)
    for _ in range(samples):
        kw = {} if verifier is None else {"verifier": verifier}
        out = list(decode(target, make_drafter(), target.decoder_prompt, params, gamma, LENGTH, gen,
                          stop_on_eos=False, **kw))
        counts[sum(t * TINY_VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(out))] += 1
    return counts


@pytest.mark.parametrize("family,drafter,params,gamma", [
    ("t5", "model", SamplingParams(temperature=1.0), 3),
    ("bart", "source-lookup", SamplingParams(temperature=0.9, top_k=6), 2),
])
def test_sampled_continuations_follow_target_law(pairs, family, drafter, params, gamma):
    module, draft_module = pairs[family]
    target, draft = Seq2SeqLM(module, set()), Seq2SeqLM(draft_module, set())
    draft.set_source(SOURCE)
    make = {"model": lambda: ModelDrafter(draft),
            "source-lookup": lambda: WithSource(PromptLookupDrafter(), SOURCE, len(target.decoder_prompt), {1})}[drafter]
    law = continuation_law(module, params, target.decoder_prompt)
    p = chi_square_p(continuation_counts(target, make, params, gamma), law)
    assert p > 1e-3, f"chi-square p={p:.2e}"


def test_negative_control_always_accept_is_detected(pairs):
    module, draft_module = pairs["t5"]
    target, draft = Seq2SeqLM(module, set()), Seq2SeqLM(draft_module, set())
    draft.set_source(SOURCE)
    params = SamplingParams(temperature=1.0)
    # 400 samples: here the loop gives p < 1e-300, and 200 multinomial draws of only 100 from always-accept's
    # exact law (two draft samples, then the target's argmax; TV 0.70 from the target's) all gave p < 1e-14
    counts = continuation_counts(target, lambda: ModelDrafter(draft), params, 3, verifier=always_accept, samples=400)
    assert chi_square_p(counts, continuation_law(module, params, target.decoder_prompt)) < 1e-6


def test_rollback_keeps_cross_attention_cache(pairs):
    module = pairs["t5"][0]
    target = Seq2SeqLM(module, set())
    target.set_source(SOURCE)
    tokens = [0, 4, 2, 6, 3, 5]
    full = target.forward(torch.tensor([tokens]))  # [1, 6, V]
    cross = [(layer.keys, layer.values) for layer in target.cache.cross_attention_cache.layers]
    assert all(k.shape[-2] == len(SOURCE) for k, _ in cross)
    target.truncate(2)
    assert target.cache.self_attention_cache.get_seq_length() == 2
    after = target.cache.cross_attention_cache.layers
    assert all(a.keys is k and a.values is v for a, (k, v) in zip(after, cross)), "rollback touched cross-attention"
    again = target.forward(torch.tensor([tokens[2:]]))  # the rolled-back positions, recomputed
    torch.testing.assert_close(again, full[:, 2:], rtol=1e-5, atol=1e-5)
    assert all(a.keys is k for a, (k, _) in zip(target.cache.cross_attention_cache.layers, cross))
    target.reset()  # a new generation over the same source keeps it too
    assert target.length == 0 and all(a.keys is k for a, (k, _) in zip(target.cache.cross_attention_cache.layers, cross))


def test_encoder_runs_once_per_request(pairs):
    module, draft_module = pairs["bart"]
    target, draft = Seq2SeqLM(module, set()), Seq2SeqLM(draft_module, set())
    calls = {"target": 0, "draft": 0}
    hooks = [m.get_encoder().register_forward_hook(lambda *_, who=who: calls.__setitem__(who, calls[who] + 1))
             for who, m in (("target", module), ("draft", draft_module))]
    try:
        target.set_source(SOURCE)
        draft.set_source(SOURCE)
        run(target, ModelDrafter(draft), SamplingParams(temperature=1.0), 3, 20, torch.Generator().manual_seed(0),
            stop_on_eos=False)
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"target": 1, "draft": 1}


# --- the user's path: saved directories with a tokenizer ----------------------------------------
def save_with_tokenizer(module: torch.nn.Module, path) -> str:
    """Save a tiny model with a word-level tokenizer over WORDS (source gets a trailing </s>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>").save_pretrained(path)
    module.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seq2seq")
    vocab = len(WORDS)
    return {
        "t5": save_with_tokenizer(tiny_t5(0, vocab=vocab), root / "t5"),
        "t5-draft": save_with_tokenizer(tiny_t5(1, layers=1, vocab=vocab, scale=2.0), root / "t5-draft"),
        "t5-other-vocab": save_with_tokenizer(tiny_t5(2, vocab=vocab + 4), root / "t5-other-vocab"),
        "bart": save_with_tokenizer(tiny_bart(0, vocab=vocab), root / "bart"),
        "llama": save_with_tokenizer(tiny_llama(0, vocab=vocab), root / "llama"),
    }


PROMPT = "the cat sat on the mat the dog sat on a mat"


def test_load_a_seq2seq_pair(saved):
    import exactspec

    engine = exactspec.load(saved["t5"], draft=saved["t5-draft"], gamma=3)
    assert engine.is_encoder_decoder and not engine.chat_template
    plain = engine.generate(PROMPT, max_new_tokens=12, temperature=0, gamma=0)
    for gamma in (3, "auto"):
        for draft in ("model", "prompt-lookup", "bigram", "auto"):
            out = engine.generate(PROMPT, max_new_tokens=12, temperature=0, gamma=gamma, draft=draft)
            assert out.token_ids == plain.token_ids, (gamma, draft)
    assert plain.prompt_token_ids == engine.tokenizer.encode(PROMPT)  # the source, EOS included
    results, _ = engine.generate_batch(PROMPT, n=2, max_new_tokens=6, temperature=1.0, seed=3)
    assert [r.token_ids for r in results] == [
        engine.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=s).token_ids for s in (3, 4)]


@pytest.mark.parametrize("target,draft,words", [
    ("t5", "llama", "decoder-only model but the target is an encoder-decoder"),
    ("llama", "t5", "encoder-decoder (T5/BART-like) model but the target is a decoder-only"),
    ("t5", "t5-other-vocab", "vocabulary"),
])
def test_bad_pairs_are_refused_in_one_line(saved, target, draft, words):
    import exactspec

    with pytest.raises(ExactSpecError, match=words.split("(")[0]):
        exactspec.load(saved[target], draft=saved[draft])
    assert_one_line_error(exactspec_cli("generate", "the cat", "--target", saved[target], "--draft", saved[draft]),
                          words)


def exactspec_cli(*args):
    return exactspec(*args, timeout=120)


def test_cli_generate_compare_on_a_t5_pair(saved):
    proc = exactspec_cli("generate", PROMPT, "--target", saved["t5"], "--draft", saved["t5-draft"], "--gamma", "3",
                         "--max-new-tokens", "10", "--compare", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["compare"]["identical"] and out["stats"]["target_calls"] >= 1


def test_server_completions_on_a_t5_pair(saved):
    import exactspec
    from exactspec.server.app import create_app

    from ..helpers.servers import _running

    engine = exactspec.load(saved["t5"], draft="prompt-lookup", gamma=4)
    ref = engine.generate(PROMPT, max_new_tokens=8, temperature=0)
    for srv in _running(create_app(engine, model_name="t5"), None):
        done = srv.client.completions.create(model="t5", prompt=PROMPT, max_tokens=8, temperature=0)
        assert done.choices[0].text == ref.text
        assert done.model_extra["speculative"]["exact"] is True
        with pytest.raises(openai.BadRequestError, match="chat template"):
            srv.client.chat.completions.create(model="t5", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("model", ["t5", "llama"])  # one-at-a-time worker; batched worker (lenient jobs leave the batch)
def test_server_reports_lenience(saved, model):
    import exactspec
    from exactspec.server.app import create_app

    from ..helpers.servers import _running

    engine = exactspec.load(saved[model], draft="prompt-lookup", gamma=4)
    for srv in _running(create_app(engine, model_name=model), None):
        done = srv.client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=1,
                                             extra_body={"lenience": 0.5})
        assert done.model_extra["speculative"]["lenience"] == 0.5 and done.model_extra["speculative"]["exact"] is False
        with pytest.raises(openai.BadRequestError, match="lenience"):
            srv.client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={"lenience": 0})
        exact = srv.client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
        assert exact.model_extra["speculative"]["exact"] is True


def test_tune_table_on_a_t5_pair(saved):
    proc = exactspec_cli("tune", "--table", "--target", saved["t5"], "--draft", saved["t5-draft"], "--gamma", "3",
                         "--temperatures", "0,1", "--workloads", "grounded", "--prompts", "1", "--max-new-tokens", "8",
                         "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [(r["drafter"], r["temperature"]) for r in out["rows"]] == [
        (d, t) for t in (0.0, 1.0) for d in ("prompt-lookup", "bigram", "model")]
    for r in out["rows"]:
        assert 0 <= r["alpha"] <= 1 and r["measured"] > 0 and r["predicted_tk"] > 0 and r["gamma"] == 3
    assert out["target_ratios"][0] == 1.0
