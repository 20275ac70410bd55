"""A suffix index over token sequences, and the drafters that copy from it.

`SuffixIndex` holds documents (token sequences) and, per n-gram order n in ORDERS, a hash table from
an n-gram to the latest position it was followed by a token, each position linking to the previous
one of the same n-gram (zlib's hash chains). A lookup hashes the context's trailing n-grams (longest
first), walks at most `chain` earlier occurrences of the longest one found, and keeps the occurrence
whose agreement with the context extends furthest back (ties: the latest). It returns what followed
that occurrence (the proposal), the match length (how far back the agreement runs, at most
`max_match`), and how often the occurrences walked were followed by the same next token (an estimate
of the proposal's first-token probability). Appending one token costs len(ORDERS) hash-table writes;
a lookup at most len(ORDERS) reads plus `chain` candidate comparisons of `max_match` tokens: both
independent of how much the index holds.

Two uses (`SuffixDrafter` combines them):
- the current request's context (prompt + committed output), indexed as it grows: the prompt-lookup
  drafter's source, without a scan over the whole context per proposal;
- a bounded store of earlier requests' outputs, per engine (so per model and tokenizer), that live
  requests write into as they commit tokens: the n samples of one request (and rows of one batch job)
  draft from each other, and an agent's next session drafts from the last one's tool calls. Its size
  is capped in MiB (`budget_mb`); the oldest documents are evicted first.

Exactness is untouched: proposals are point masses and go through the same verifier as any draft.
At T > 0 a seeded request's text then depends on what the store held (as with `--draft auto`).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..speculative.interfaces import Proposal
from ..speculative.sampling import SamplingParams
from .rewrites import Rewrites

if TYPE_CHECKING:
    from .prompt_indexes import PromptIndexes

ORDERS = (3, 2, 1)  # n-gram orders indexed, longest first (the prompt-lookup drafter's 3..1)
CHAIN = 32  # earlier occurrences compared per lookup
MAX_MATCH = 64  # longest match length worth measuring: beyond it the copy is as good as certain
STRIDE = 1 << 32  # a position is doc * STRIDE + offset
LEAD_IN = 8  # prompt tokens stored before a request's output, so that its first tokens can match
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


class SuffixDrafter:
    """Copies what followed the best earlier occurrence of the context's tail: in the request's own
    context (prompt + output, indexed as it grows) and, given a `store`, in every document the store
    holds (earlier requests' outputs, this request's siblings). The longer match wins; a tie goes to the
    context. With a store, the drafter writes the request's last LEAD_IN prompt tokens and its output
    into the store as they are committed, so that others can copy from them while it still runs.

    Deterministic, so proposals are point masses (probs=None), exact at any temperature. `copies`: any
    prefix of a proposal may be verified (auto γ cuts it by the match length it reports). After each
    proposal, `source` ("context" or "store") and `found` (the Match) say where it came from. A copy from
    the prompt writes what the answer has rewritten of it so far (`rewrites`, drafters/rewrites.py).
    `shortest`: matches shorter than this are not looked for (the auto drafter sets it to the shortest
    match auto γ could be paid for: in open chat a one-token match never is, and its lookup walks the
    most occurrences). `prompts`: the engine's recent prompts' indexes (drafters/prompt_indexes.py): a
    generation starts from a copy of the longest its prompt begins with, and leaves its prompt's there."""

    copies = True

    def __init__(self, store: SuffixIndex | None = None, own_context: bool = True, name: str | None = None,
                 max_match: int = MAX_MATCH, orders: tuple[int, ...] = ORDERS,
                 prompts: PromptIndexes | None = None) -> None:
        self.store, self.max_match, self.orders, self.prompts = store, max_match, orders, prompts
        self.name = name or ("suffix" if own_context else "store")
        self.index = SuffixIndex(max_match=max_match, orders=orders) if own_context else None
        self._doc = self.index.new_doc() if self.index is not None else None
        self._begun = False  # the context indexed so far began a generation (`sync`)
        self.rewrites: Rewrites | None = Rewrites() if own_context else None  # None: copies verbatim only
        self._store_doc: int | None = None
        self._stored = 0  # context tokens written to the store (absolute offset in the context)
        self.source: str | None = None
        self.found: Match | None = None
        self.shortest = 1

    @property
    def sources(self) -> tuple[str, ...]:
        """Where its copies may come from ("context", "store"): what auto γ prices them by."""
        return (("context",) if self.index is not None else ()) + (("store",) if self.store is not None else ())

    def sync(self, context: list[int]) -> None:
        """Index the context tokens not seen yet (the context only grows within one generation)."""
        if self.index is not None:
            seen = self._indexed(context)
            if seen is None:  # a generation's first proposal (or its prompt's reading): its context is the prompt
                self._begin(context)
            else:
                self.index.extend(self._doc, context[seen:])
            if self.rewrites is not None:
                self.rewrites.track(context)
        if self.store is not None:
            self._write(context)

    def _indexed(self, context: list[int]) -> int | None:
        """How many of `context`'s tokens the index holds, or None where it holds something else or this
        generation has not begun."""
        indexed = self.index.docs[self._doc].tokens
        seen = len(indexed)
        if not self._begun or seen > len(context) or (seen and indexed[seen - 1] != context[seen - 1]):
            return None
        return seen

    def _begin(self, prompt: list[int]) -> None:
        """A generation's index: from the longest recent index its prompt begins with (`prompts`), else new;
        the prompt's index is kept there in turn, for its next samples and repeats."""
        if self.prompts is not None:
            self.index, self._doc = self.prompts.start(prompt, self.max_match, self.orders)
        elif self.index.docs[self._doc].tokens:  # a drafter's next generation: a new index
            self.index = SuffixIndex(max_match=self.max_match, orders=self.orders)
            self._doc = self.index.new_doc()
        rest = prompt[len(self.index.docs[self._doc].tokens):]
        self.index.extend(self._doc, rest)
        if self.prompts is not None and rest:  # (a prompt kept as it is is not kept again)
            self.prompts.keep(self.index.copy(), self._doc)
        if self.rewrites is not None:
            self.rewrites.start(len(prompt))
        self._begun = True

    def read_prompt(self, prompt: list[int]) -> None:
        """Index the prompt before decoding (`ReadsPrompt`): the first proposal then indexes nothing."""
        self.sync(prompt)

    def _write(self, context: list[int]) -> None:
        with self.store.lock:
            if self._store_doc is None or not self.store.alive(self._store_doc):  # first write, or evicted
                self._store_doc, self._stored = self.store.new_doc(), max(0, len(context) - LEAD_IN)
            if len(context) > self._stored:
                self.store.extend(self._store_doc, context[self._stored:])
                self._stored = len(context)

    def seen_tail(self, context: list[int], below: int) -> int:
        """`Lookups.seen_tail`: the longest over the drafter's sources. While the answer is aligned with the
        prompt it copies (`rewrites`), a copy may resume past a rewrite with no n-gram match at all: then
        the longest below `below` (the next step looks up)."""
        if self.rewrites is not None and self.rewrites.aligned is not None:
            return below - 1
        seen = 0
        if self.index is not None:
            seen = next((n for o, n in enumerate(self.orders) if n < below and self._seen(context, o, n)), 0)
        if self.store is not None:
            with self.store.lock:
                seen = max(seen, self.store.seen_tail(context, below))
        return seen

    def _seen(self, context: list[int], o: int, n: int) -> bool:
        """Whether the context's trailing n-gram (order index o) occurred before, followed by a token: in the
        index, or among the tokens since the last lookup, not indexed yet (auto γ asks `seen_tail` instead of
        looking up where it can tell that nothing is to be found: propose.cannot_match)."""
        if len(context) < n:
            return False
        gram = context[-n:]
        if hash(tuple(gram)) in self.index.heads[o]:
            return True
        indexed = len(self.index.docs[self._doc].tokens)
        return any(context[end - n:end] == gram for end in range(max(indexed, n), len(context)))

    def lookup(self, context: list[int]) -> tuple[SuffixIndex, Match] | None:
        """The best match of the context's tail among the drafter's sources, with the index holding it."""
        best = None
        for name, index in (("context", self.index), ("store", self.store)):
            if index is None:
                continue
            if index is self.store:
                with index.lock:
                    match = index.find(context, self.shortest)
            else:  # the request's own index: no one else's
                match = index.find(context, self.shortest)
            if match is not None and (best is None or match.length > best[1].length):
                best, self.source = (index, match), name
        return best

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                law=None) -> Proposal:
        self.sync(context)
        self.source = self.found = None
        if k <= 0:
            return Proposal.empty()
        best = self.lookup(context)
        if self.rewrites is not None:
            best = self._through_rewrites(context, best)
        if best is None:
            return Proposal.empty()
        index, self.found = best
        if index is self.index and self.rewrites is not None:
            follow = self.rewrites.follow(context, self.found.at, k)
        else:
            follow = index.continuation(self.found, k)
        if index is self.store:  # another request's text: only as far as what the store saw agrees
            with self.store.lock:
                follow = follow[: self.store.supported(context, follow)]
            if not follow and self.index is not None:  # contested at once: the context's own match, if any
                self.source, found = "context", self.index.find(context, self.shortest)
                if found is not None:
                    self.found, follow = found, self.index.continuation(found, k)
        if not follow:
            return Proposal.empty()
        return Proposal(follow, None, self.found.length)  # a list (Proposal.tokens)

    def _through_rewrites(self, context: list[int], best: tuple[SuffixIndex, Match] | None
                          ) -> tuple[SuffixIndex, Match] | None:
        """The lookup's match, or where the answer's copy of the prompt continues past its rewrites when
        that copy has run longer than the match (the match then is the copy's run)."""
        if best is not None and best[0] is self.index:
            self.rewrites.anchor(context, best[1].at, best[1].length)
        at = self.rewrites.at_tail(context)
        if at is None or (best is not None and best[1].length > self.rewrites.run):
            return best
        self.source = "context"
        return self.index, Match(self._doc, at, min(self.rewrites.run, self.max_match), 0, 0)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        pass

    def finish(self, context: list[int]) -> None:
        """The generation ended with this context: its last tokens go to the store too."""
        if self.store is not None:
            self._write(context)


class PromptLookupDrafter(SuffixDrafter):
    """Prompt lookup (Saxena 2023): copies from the request's own context only, matching its trailing
    n-grams for n = max_ngram..min_ngram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_match: int = MAX_MATCH,
                 prompts: PromptIndexes | None = None) -> None:
        super().__init__(None, True, "prompt-lookup", max_match, tuple(range(max_ngram, min_ngram - 1, -1)), prompts)
