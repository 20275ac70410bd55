"""Recent prompts' indexes, so that a request whose prompt begins with one of them indexes only the rest.

Prompt lookup indexes every prompt token before decoding (drafters/suffix_index.py: one hash-table write per
n-gram order a token), which an agent pays for its whole conversation at every step: the next step's
prompt is the last one's, its answer and a tool's result. A request's samples, and the runs of
`--compare`, send one prompt several times. `PromptIndexes` keeps the indexes of the last few prompts
as they were read, and a drafter whose prompt begins with one's tokens starts from a copy of it
(dictionary and array copies) and indexes only the tokens after them. (A finished generation's context
is not kept: copying or handing it over cost more, in a short answer, than indexing the answer again
saves an agent's next step.)

A copy holds the tables an index built from scratch over the same tokens holds, so the drafts are the
same either way (tests/drafters/test_prompt_indexes.py); and the output never depends on the drafts.
"""

from __future__ import annotations

import threading

from .suffix_index import BYTES_PER_TOKEN, SuffixIndex

PROMPT_INDEX_MB = 16  # the most the kept indexes may hold together (at BYTES_PER_TOKEN a token)
KEPT = 8  # indexes kept at most (the most recently used stay)


class PromptIndexes:
    """The last few prompts' indexes (single documents), shared by an engine's drafters: `start` gives a
    generation a copy of the longest its prompt begins with, `keep` adds one. `reused`: prompt tokens
    copied instead of indexed, since the start."""

    def __init__(self, budget_mb: float = PROMPT_INDEX_MB, kept: int = KEPT) -> None:
        self.budget = int(budget_mb * 2**20) // BYTES_PER_TOKEN  # tokens, over every kept index
        self.most = kept
        self._kept: list[tuple[SuffixIndex, int]] = []  # (index, its document), least recently used first
        self._lock = threading.Lock()  # a server's requests start from several threads
        self.reused = 0

    def start(self, prompt: list[int], max_match: int, orders: tuple[int, ...]) -> tuple[SuffixIndex, int]:
        """(index, document) for a generation whose prompt is `prompt`: a copy of the kept index (of these
        `max_match` and `orders`) whose tokens are the longest beginning of `prompt`, or a new, empty one.
        The caller indexes the rest of the prompt."""
        with self._lock:
            found, longest = None, 0
            for i, (index, doc) in enumerate(self._kept):
                tokens = index.docs[doc].tokens
                n = len(tokens)
                if (longest < n <= len(prompt) and index.orders == orders and index.max_match == max_match
                        and tokens[-1] == prompt[n - 1] and tokens == prompt[:n]):
                    found, longest = i, n
            if found is not None:
                index, doc = self._kept.pop(found)
                self._kept.append((index, doc))
                self.reused += longest
                return index.copy(), doc
        index = SuffixIndex(max_match=max_match, orders=orders)
        return index, index.new_doc()

    def keep(self, index: SuffixIndex, doc: int) -> None:
        """Keep `index`, whose only document is `doc`, for later prompts that begin with its tokens (the
        caller must not write it afterwards). Where a kept index holds the same tokens, that one stays (as
        the most recently used); the least recently used go while more than `most`, or more tokens than
        the budget, are kept."""
        tokens = index.docs[doc].tokens
        if not tokens or len(tokens) > self.budget or len(index.docs) != 1:
            return
        with self._lock:
            same = next((j for j, (i, d) in enumerate(self._kept) if i.docs[d].tokens == tokens), None)
            self._kept.append(self._kept.pop(same) if same is not None else (index, doc))
            if same is not None:
                return
            held = sum(len(i.docs[d].tokens) for i, d in self._kept)
            while len(self._kept) > self.most or held > self.budget:
                old, d = self._kept.pop(0)
                held -= len(old.docs[d].tokens)
