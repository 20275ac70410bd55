"""Incremental detokenisation: exactly the text a whole decode gives, at a cost per token that stays flat."""

from __future__ import annotations

import random

import pytest

from exactspec.detokenize import IncrementalText
from exactspec.embedded import embedded_model_path
from exactspec.engine import Engine, GenerationResult
from exactspec.models.torch_hf import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


def _multibyte_ids(tokenizer) -> list[int]:
    """Ids of text whose characters span several byte-level tokens (emoji, CJK, accents)."""
    return tokenizer.encode("héllo wörld — 日本語のテキスト 🎉🚀 naïve café ½ ∑ 𝔘𝔫𝔦", add_special_tokens=False)


def _random_ids(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    pool = _multibyte_ids(tokenizer) + tokenizer.encode(' {"tool": "search", "q": "x"}\n\n', add_special_tokens=False)
    vocab = len(tokenizer)
    # mostly real text pieces, some arbitrary tokens (partial bytes, special tokens included)
    return [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_text_equals_whole_decode_at_every_step(tokenizer, seed):
    ids = _random_ids(tokenizer, 300, seed)
    text = IncrementalText(tokenizer)
    for i, token in enumerate(ids):
        text.add(token)
        assert text.text == tokenizer.decode(ids[: i + 1], skip_special_tokens=True)


def test_partial_utf8_is_pending_until_complete(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes span several tokens
    text = IncrementalText(tokenizer)
    for token in ids[:-1]:
        text.add(token)
        assert text.text.endswith("\ufffd") and text.committed == "" and text.safe_length(final=False) == 0
    text.add(ids[-1])
    assert text.text == "🎉" and text.safe_length(final=False) == 1


def test_stop_string_found_once_and_first(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma END delta STOP", add_special_tokens=False)
    text = IncrementalText(tokenizer, ["END", "STOP", ""])
    hits = []
    for token in ids:
        text.add(token)
        hits.append(text.stop_at)
    whole = tokenizer.decode(ids)
    assert text.stop_at == whole.find("STOP")
    first = next(i for i, h in enumerate(hits) if h >= 0)
    assert tokenizer.decode(ids[: first + 1]).find("STOP") >= 0 > tokenizer.decode(ids[:first]).find("STOP")


def test_stop_string_split_across_tokens_and_held_back(tokenizer):
    text = IncrementalText(tokenizer, ["</tool>"])
    for token in tokenizer.encode("result: 42</to", add_special_tokens=False):
        text.add(token)
    assert text.stop_at < 0 and text.text[: text.safe_length(False)] == "result: 42"
    for token in tokenizer.encode("ol> more", add_special_tokens=False):
        text.add(token)
    assert text.text[: text.stop_at] == "result: 42"


class _Counting:
    """The tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids_decoded = tokenizer, 0
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces

    def decode(self, ids, **kwargs):
        self.ids_decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _per_token_costs(engine, counting, ids):
    result, costs, sent = GenerationResult("", [], [1], "length"), [], 0
    for token in ids:
        before = counting.ids_decoded
        piece, done = engine.append_tokens(result, [token], ["<never-appears>"], sent)
        sent += len(piece)
        assert not done
        costs.append(counting.ids_decoded - before)
    return result, costs


def test_cost_measure_flags_whole_decoding(tokenizer, tiny_target):
    """Negative control: a tokenizer that must be decoded whole (clean-up of spaces) shows the growth."""
    counting = _Counting(tokenizer)
    counting.clean_up_tokenization_spaces = True
    engine = Engine(tiny_target, counting, draft="none", gamma=0, chat_template=False)
    ids = [t for t in _random_ids(tokenizer, 600, 7) if t not in tiny_target.eos_token_ids]
    result, costs = _per_token_costs(engine, counting, ids)
    assert result.text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
    assert sum(costs[-100:]) > 3 * sum(costs[:100])


def test_long_generation_costs_no_more_per_token_at_the_end(tokenizer, tiny_target):
    """2,000 tokens through the engine's own detokenisation (the server's path): the decode work and
    the stop-string search per token over the last 100 tokens are no more than over the first 100
    (a whole re-decode per token would make them ~20x larger)."""
    counting = _Counting(tokenizer)
    engine = Engine(tiny_target, counting, draft="none", gamma=0, chat_template=False)
    result = GenerationResult("", [], [1], "length")
    ids = [t for t in _random_ids(tokenizer, 2000, 7) if t not in tiny_target.eos_token_ids]
    costs, sent = [], 0
    for token in ids:
        before = (counting.ids_decoded, result.detokenizer.decoded_chars + result.detokenizer.scanned_chars
                  if result.detokenizer else 0)
        piece, done = engine.append_tokens(result, [token], ["<never-appears>"], sent)
        sent += len(piece)
        assert not done
        detok = result.detokenizer
        costs.append((counting.ids_decoded - before[0], detok.decoded_chars + detok.scanned_chars - before[1]))
    assert len(ids) >= 1990 and result.text == tokenizer.decode(ids, skip_special_tokens=True)
    first, last = costs[:100], costs[-100:]
    for k in (0, 1):
        assert sum(c[k] for c in last) <= 1.5 * sum(c[k] for c in first) + 100


def test_tokens_within_counts_tokens_whose_text_is_released(tokenizer):
    ids = tokenizer.encode("ok 🎉 café, done", add_special_tokens=False)
    text = IncrementalText(tokenizer)
    for i, token in enumerate(ids):
        text.add(token)
        safe = text.safe_length(final=False)
        n = text.tokens_within(safe)
        released = tokenizer.decode(ids[:n])
        assert "\ufffd" not in released and text.text[:safe].startswith(released)
        assert n == i + 1 or "\ufffd" in tokenizer.decode(ids[: n + 1])  # the next token's text is not complete
    assert text.tokens_within(len(text.text)) == len(ids)
    text.add(tokenizer.eos_token_id)  # no text: it counts with the text after it, here none
    assert text.tokens_within(len(text.text)) == len(ids)
    text.add(tokenizer.encode("!", add_special_tokens=False)[0])
    assert text.tokens_within(len(text.text)) == len(ids) + 2
