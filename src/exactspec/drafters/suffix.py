"""The drafters that copy from suffix indexes (drafters/suffix_index.py).

Two sources (`SuffixDrafter` combines them):
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

import torch

from ..speculative.interfaces import Proposal
from ..speculative.sampling import SamplingParams
from .prompt_indexes import PromptIndexes
from .rewrites import Rewrites
from .suffix_index import MAX_MATCH, ORDERS, Match, SuffixIndex

LEAD_IN = 8  # prompt tokens stored before a request's output, so that its first tokens can match
CATCH_UP = 16  # tokens not indexed yet that `seen_tail` scans; past them it indexes them (`_caught_up`)


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
            indexed = self._caught_up(context)
            seen = next((n for o, n in enumerate(self.orders) if n < below and self._seen(context, o, n, indexed)), 0)
        if self.store is not None:
            with self.store.lock:
                seen = max(seen, self.store.seen_tail(context, below))
        return seen

    def _caught_up(self, context: list[int]) -> int:
        """How many of `context`'s tokens the index holds, after indexing those since the last lookup where
        they are more than CATCH_UP (a long answer whose lookups all find nothing would rescan them all at
        every step: `_seen`); the rewrites follow them at the next lookup (`sync`)."""
        indexed = len(self.index.docs[self._doc].tokens)
        if len(context) - indexed > CATCH_UP and self._indexed(context) is not None:
            self.index.extend(self._doc, context[indexed:])
            indexed = len(context)
        return indexed

    def _seen(self, context: list[int], o: int, n: int, indexed: int) -> bool:
        """Whether the context's trailing n-gram (order index o) occurred before, followed by a token: in the
        index, or among the context's tokens from `indexed` on, not indexed yet (auto γ asks `seen_tail`
        instead of looking up where it can tell that nothing is to be found: lookups.cannot_match)."""
        if len(context) < n:
            return False
        gram = context[-n:]
        if hash(tuple(gram)) in self.index.heads[o]:
            return True
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
