"""A suffix index over token sequences: hash-chained n-gram tables that find the longest earlier
occurrence of a context's tail.

`SuffixIndex` holds documents (token sequences) and, per n-gram order n in ORDERS, a hash table from
an n-gram to the latest position it was followed by a token, each position linking to the previous
one of the same n-gram (zlib's hash chains). A lookup hashes the context's trailing n-grams (longest
first), walks at most `chain` earlier occurrences of the longest one found, and keeps the occurrence
whose agreement with the context extends furthest back (ties: the latest). It returns what followed
that occurrence (the proposal), the match length (how far back the agreement runs, at most
`max_match`), and how often the occurrences walked were followed by the same next token (an estimate
of the proposal's first-token probability). Appending one token costs len(ORDERS) hash-table writes;
a lookup at most len(ORDERS) reads plus `chain` candidate comparisons of `max_match` tokens: both
independent of how much the index holds. The drafters that copy from it: drafters/suffix.py.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

ORDERS = (3, 2, 1)  # n-gram orders indexed, longest first (the prompt-lookup drafter's 3..1)
CHAIN = 32  # earlier occurrences compared per lookup
MAX_MATCH = 64  # longest match length worth measuring: beyond it the copy is as good as certain
STRIDE = 1 << 32  # a position is doc * STRIDE + offset
# What one stored token costs in a CPython process (tokens list, chain arrays, hash-table entries):
# measured with tracemalloc: 270-320 bytes in one large document, up to 460 in many short ones
# (hash tables grow by doubling); tests/drafters/test_suffix.py checks that a store keeps to its budget.
BYTES_PER_TOKEN = 512


@dataclass
class Match:
    """The best earlier occurrence of the context's tail: where its continuation starts, how far back
    it agrees with the context, and how many of the occurrences walked had the same next token."""

    doc: int
    at: int  # offset in the document of the first continuation token
    length: int  # match length (>= the n-gram order that found it)
    agree: int  # occurrences walked whose next token equals this one's
    seen: int  # occurrences walked (with the same n-gram)

    @property
    def probability(self) -> float:
        """Estimated probability that the continuation's first token comes next: the share of earlier
        occurrences followed by it, shrunk towards 1/2 (one occurrence says little)."""
        return (self.agree + 1) / (self.seen + 2)


class _Doc:
    __slots__ = ("tokens", "prev", "tables")

    def __init__(self, orders: tuple[int, ...], heads: list[dict[int, int]]) -> None:
        self.tokens: list[int] = []
        self.prev = [array("q") for _ in orders]  # per order: previous position of the n-gram ending here
        self.tables = list(zip(orders, heads, self.prev))  # per order: n, the index's hash table, its chain links


class SuffixIndex:
    """Documents of token ids with hash-chained n-gram tables (see the module docstring). `budget_mb`:
    evict the oldest documents past this size (None: unbounded, for one request's context)."""

    def __init__(self, budget_mb: float | None = None, chain: int = CHAIN, max_match: int = MAX_MATCH,
                 orders: tuple[int, ...] = ORDERS) -> None:
        self.budget = None if budget_mb is None else int(budget_mb * 2**20)
        self.chain, self.max_match, self.orders = chain, max_match, orders
        self.docs: dict[int, _Doc] = {}
        self.heads: list[dict[int, int]] = [{} for _ in orders]
        self.tokens = 0  # held in live documents
        self._next_doc = 0
        self.lock = threading.Lock()  # Ray / server threads may share one store

    @property
    def nbytes(self) -> int:
        """Estimated memory held (BYTES_PER_TOKEN per stored token)."""
        return self.tokens * BYTES_PER_TOKEN

    def new_doc(self) -> int:
        doc = self._next_doc
        self._next_doc += 1
        self.docs[doc] = _Doc(self.orders, self.heads)
        return doc

    def alive(self, doc: int) -> bool:
        return doc in self.docs

    def length(self, doc: int) -> int:
        d = self.docs.get(doc)
        return len(d.tokens) if d is not None else 0

    def copy(self) -> "SuffixIndex":
        """An index holding what this one holds, sharing nothing with it (`PromptIndexes` hands a copy of
        a recent prompt's index to the next request that begins with it)."""
        twin = SuffixIndex(None, self.chain, self.max_match, self.orders)
        twin.budget, twin.tokens, twin._next_doc = self.budget, self.tokens, self._next_doc
        twin.heads = [head.copy() for head in self.heads]
        for doc, d in self.docs.items():
            t = twin.docs[doc] = _Doc(self.orders, twin.heads)
            t.tokens = list(d.tokens)
            t.prev = [array("q", links) for links in d.prev]
            t.tables = list(zip(self.orders, twin.heads, t.prev))
        return twin

    def extend(self, doc: int, tokens: list[int]) -> None:
        """Append tokens to a document, indexing each n-gram that now has a next token."""
        d = self.docs[doc]
        seq, base, tables = d.tokens, doc * STRIDE, d.tables
        if self.budget is not None:  # one document alone never outgrows the budget: its tail is not kept
            tokens = tokens[: max(0, self.budget // BYTES_PER_TOKEN - len(seq))]
        if len(tokens) <= 8:  # a step's tokens (every step of every request appends some: kept tight)
            for token in tokens:
                end = len(seq)  # the new token's offset: the n-grams ending here are followed by it
                seq.append(token)
                for n, head, prev in tables:
                    if end < n:
                        prev.append(-1)
                        continue
                    key = hash(tuple(seq[end - n : end]))
                    prev.append(head.get(key, -1))
                    head[key] = base + end
        else:  # a prompt (before its prefill: `ReadsPrompt`): order by order, its n-grams zipped
            start = len(seq)
            seq.extend(tokens)
            for n, head, prev in tables:
                first = min(max(start, n), len(seq))  # the first offset with n tokens before it
                prev.extend([-1] * (first - start))
                for end, gram in enumerate(zip(*(seq[first - n + j: len(seq) - n + j] for j in range(n))), first):
                    key = hash(gram)  # gram == tuple(seq[end - n : end])
                    prev.append(head.get(key, -1))
                    head[key] = base + end
        self.tokens += len(tokens)
        if self.budget is not None and self.nbytes > self.budget:
            self._evict(keep=doc)

    def _evict(self, keep: int) -> None:
        """Drop the oldest documents (never `keep`) while over budget, with their hash-table heads."""
        while self.nbytes > self.budget and len(self.docs) > 1:
            doc = next(d for d in self.docs if d != keep)
            d = self.docs.pop(doc)
            seq, base = d.tokens, doc * STRIDE
            for o, n in enumerate(self.orders):
                head = self.heads[o]
                for end in range(n, len(seq)):
                    key = hash(tuple(seq[end - n : end]))
                    if head.get(key) == base + end:
                        del head[key]
            self.tokens -= len(seq)

    def find(self, tail: list[int], shortest: int = 1) -> Match | None:
        """The best earlier occurrence of `tail`'s trailing n-gram (longest order first), or None.
        `tail` needs only its last `max_match` tokens. A document's own last n-gram is not indexed
        until a token follows it, so a context never matches its own tail. Orders shorter than
        `shortest` (and than the longest order) are not looked up: a match they find would be shorter."""
        shortest = min(shortest, self.orders[0])
        for o, n in enumerate(self.orders):
            if len(tail) < n or n < shortest:
                continue
            gram = tail[-n:]
            latest = self.heads[o].get(hash(tuple(gram)), -1)
            if latest < 0:  # never seen (most lookups): no walk set up
                continue
            best, nexts = None, []
            for doc, end, seq in self._occurrences(o, gram, latest):
                nexts.append(seq[end])
                if best is None or self._longer(seq, end, tail, best.length):
                    best = Match(doc, end, self._agreement(seq, end, tail, n if best is None else best.length + 1), 0, 0)
                    if best.length >= self.max_match:
                        break
            if best is not None:
                best.seen, best.agree = len(nexts), nexts.count(self.docs[best.doc].tokens[best.at])
                return best
        return None

    def seen_tail(self, tail: list[int], below: int) -> int:
        """The longest order n < `below` whose trailing n-gram of `tail` the index holds an earlier
        occurrence of (0: none). Where the order above it holds none, the tail's match is n tokens long."""
        for o, n in enumerate(self.orders):
            if n < below and n <= len(tail) and hash(tuple(tail[-n:])) in self.heads[o]:
                return n
        return 0

    def _occurrences(self, o: int, gram: list[int], latest: int | None = None) -> Iterator[tuple[int, int, list[int]]]:
        """(doc, end, its tokens) of the earlier occurrences of `gram` (order index o), latest first,
        at most `chain` of them walked; `latest`: the position its hash table holds, if looked up already."""
        pos = self.heads[o].get(hash(tuple(gram)), -1) if latest is None else latest
        n, walked = len(gram), 0
        while pos >= 0 and walked < self.chain:
            walked += 1
            doc, end = divmod(pos, STRIDE)
            d = self.docs.get(doc)
            if d is None:  # evicted: everything further down the chain is older
                return
            pos = d.prev[o][end]
            if d.tokens[end - n : end] == gram:  # else a hash collision
                yield doc, end, d.tokens

    def _agreement(self, seq: list[int], end: int, tail: list[int], known: int) -> int:
        """How many tokens before `end` in `seq` agree with the end of `tail` (at least `known`)."""
        length, limit = known, min(self.max_match, end, len(tail))
        while length < limit and seq[end - length - 1] == tail[-length - 1]:
            length += 1
        return length

    def _longer(self, seq: list[int], end: int, tail: list[int], than: int) -> bool:
        """Whether this occurrence agrees further back than `than` tokens (cheap test first)."""
        if than >= min(end, len(tail)) or seq[end - than - 1] != tail[-than - 1]:
            return False
        return seq[end - than - 1 : end] == tail[-than - 1 :]

    def supported(self, tail: list[int], follow: list[int]) -> int:
        """How many leading tokens of `follow` (a continuation of `tail`) the index does not contest: at
        each position, among the earlier occurrences of the preceding n-gram (longest order, at most
        `chain`), the proposed token must not be outnumbered by the others (SuffixDecoding's idea:
        stop where what followed before disagrees). Where the store has seen several sessions of a
        task diverge (a file name, a number), a copy stops there instead of running on into a value
        that is somebody else's."""
        n = self.orders[0]
        seq = list(tail[-n:]) + list(follow)
        for j, token in enumerate(follow):
            gram = seq[j:j + n]
            if len(gram) < n:
                return len(follow)
            nexts = [tokens[end] for _, end, tokens in self._occurrences(0, gram)]
            if len(nexts) >= 2 and 2 * nexts.count(token) < len(nexts):
                return j
        return len(follow)

    def continuation(self, match: Match, k: int) -> list[int]:
        """Up to k tokens that followed the match."""
        return self.docs[match.doc].tokens[match.at : match.at + k]
