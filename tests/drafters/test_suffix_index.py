"""The suffix index (drafters/suffix_index.py): lookups agree with a full scan over the context, a prompt
indexed at once holds what one indexed token by token holds, `seen_tail` is the match a lookup of the
orders below would find, and a lookup walks a bounded number of occurrences."""

from __future__ import annotations

import random

import pytest

from exactspec.drafters.suffix_index import MAX_MATCH, SuffixIndex


def scan(context: list[int], max_ngram: int = 3, max_match: int = MAX_MATCH) -> tuple[int, int]:
    """The reference: every earlier occurrence of the tail's n-gram (n = 3..1), latest first; the one
    agreeing furthest back wins. -> (index of the continuation, match length); (-1, 0) if none."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), 0, -1):
        tail, best, best_len = context[n_ctx - n:], -1, 0
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == tail:
                length = n
                while (length < max_match and start + n - length - 1 >= 0
                       and context[start + n - length - 1] == context[n_ctx - length - 1]):
                    length += 1
                if length > best_len:
                    best, best_len = start + n, length
        if best >= 0:
            return best, best_len
    return -1, 0


@pytest.mark.parametrize("seed", range(6))
def test_index_lookup_equals_a_full_scan(seed):
    """On texts that repeat themselves (copies with edits), the indexed lookup finds the same match
    length as scanning every occurrence, and its continuation is what followed an occurrence that long."""
    rng = random.Random(seed)
    base = [rng.randrange(20) for _ in range(60)]
    text = base + [rng.randrange(20) if rng.random() < 0.1 else t for t in base]  # a copy with edits
    index = SuffixIndex(chain=10_000)
    doc = index.new_doc()
    for end in range(1, len(text)):
        index.extend(doc, text[end - 1:end])  # grows one token at a time, as a context does
        context = text[:end]
        at, length = scan(context)
        found = index.find(context[-MAX_MATCH:])
        assert (found.length if found else 0) == length, end
        if found:
            assert context[found.at - found.length:found.at] == context[-found.length:]
            assert at >= 0


def test_a_lookup_for_longer_matches_finds_what_the_full_lookup_finds_that_long():
    """`find(tail, shortest)` looks up only the n-gram orders of at least `shortest` tokens (and always
    the longest): it finds the full lookup's match wherever that match is that long, and nothing shorter."""
    rng = random.Random(7)
    base = [rng.randrange(12) for _ in range(80)]
    text = base + [rng.randrange(12) if rng.random() < 0.2 else t for t in base]
    index = SuffixIndex()
    doc = index.new_doc()
    lengths = set()
    for end in range(1, len(text)):
        index.extend(doc, text[end - 1:end])
        tail = text[:end][-MAX_MATCH:]
        full = index.find(tail)
        lengths.add(full.length if full else 0)
        for shortest in (2, 3, 5):
            found = index.find(tail, shortest)
            if full is not None and full.length >= min(shortest, 3):
                assert (found.at, found.length) == (full.at, full.length)
            else:
                assert found is None
    assert {0, 1, 2} <= lengths and max(lengths) >= 5  # every branch was taken


def test_a_prompt_indexed_at_once_is_indexed_as_token_by_token():
    """SuffixIndex.extend of many tokens (a prompt, order by order) leaves the hash tables and chains that
    appending them one at a time does, wherever the document already stood."""
    rng = random.Random(5)
    for _ in range(300):
        text = [rng.randrange(8) for _ in range(rng.randrange(0, 40))]
        cut = rng.randrange(0, len(text) + 1)
        one, bulk = SuffixIndex(), SuffixIndex()
        a, b = one.new_doc(), bulk.new_doc()
        for token in text:
            one.extend(a, [token])
        bulk.extend(b, text[:cut])
        bulk.extend(b, text[cut:])
        assert bulk.heads == one.heads and bulk.tokens == one.tokens == len(text)
        assert [list(p) for p in bulk.docs[b].prev] == [list(p) for p in one.docs[a].prev]


def test_seen_tail_is_the_match_length_below_the_orders_looked_up():
    """`seen_tail(tail, below)`: where a lookup of the orders from `below` on finds nothing, the tail's
    match is exactly the longest lower order whose n-gram occurred before (the reference scan's length)."""
    rng = random.Random(3)
    text = [rng.randrange(30) for _ in range(200)]
    index = SuffixIndex()
    doc = index.new_doc()
    below_seen = set()
    for end in range(1, len(text)):
        index.extend(doc, text[end - 1:end])
        context = text[:end]
        for below in (2, 3):
            if index.find(context, below) is None:
                seen = index.seen_tail(context, below)
                assert seen == min(scan(context)[1], below - 1) == scan(context)[1], end
                below_seen.add(seen)
    assert below_seen == {0, 1, 2}  # every length was met


def test_lookup_reads_a_bounded_number_of_occurrences():
    """A token seen 10^5 times: the lookup compares at most `chain` occurrences, whatever the history."""
    index = SuffixIndex(chain=8)
    doc = index.new_doc()
    index.extend(doc, [5, 6] * 50_000)
    calls = 0
    real = index._longer

    def counting(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    index._longer = counting
    found = index.find([1, 5])
    assert found is not None and calls <= 8
