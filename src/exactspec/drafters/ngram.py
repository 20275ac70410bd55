"""Model-free drafters: prompt lookup (point masses) and unigram / bigram (paper Table 3)."""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from ..spec.sampling import SamplingParams, sample, warp
from ..spec.interfaces import Proposal


MAX_MATCH = 64  # longest match length worth measuring: beyond it the copy is as good as certain


class PromptLookupDrafter:
    """Copies what followed an earlier occurrence of the context's tail. Among the earlier occurrences of
    the trailing n-gram (n = max_ngram..1) it takes the one whose agreement with the context extends
    furthest back (ties: the latest) and reports that MATCH LENGTH with the proposal: inside a long copy
    (an edit's untouched lines) it is long and the copy runs on; right after an edit point it is short.
    The proposal is the up to k tokens that followed the match, so a policy that trusts long matches
    can take 16-32 tokens at once (`copies`: any prefix of the proposal may be used).
    Deterministic, so proposals are point masses (probs=None); exact at any temperature because the
    verifier treats q as a one-hot law. How recent proposals fared is
    kept by the auto-γ policy, per match length (costmodel.Acceptance), where it steers the next γ."""

    name = "prompt-lookup"
    copies = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_match: int = MAX_MATCH):
        self.max_ngram, self.min_ngram, self.max_match = max_ngram, min_ngram, max_match

    def find(self, context: list[int]) -> tuple[int, int]:
        """(index where the copied continuation starts, match length); (-1, 0) if the tail never occurred."""
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = context[n_ctx - n :]
            best, best_len = -1, 0
            for start in range(n_ctx - n - 1, -1, -1):  # latest first, never the tail itself
                if context[start] == tail[0] and context[start : start + n] == tail:
                    length = n  # extend the agreement backwards
                    while (length < self.max_match and start + n - length - 1 >= 0
                           and context[start + n - length - 1] == context[n_ctx - length - 1]):
                        length += 1
                    if length > best_len:
                        best, best_len = start + n, length
                        if length >= self.max_match:
                            break
            if best >= 0:
                return best, best_len
        return -1, 0

    def propose(self, context, k, params, generator, law=None) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        at, match = self.find(context)
        follow = context[at : at + k] if at >= 0 else []
        if not follow:
            return Proposal.empty()
        return Proposal(torch.tensor(follow, dtype=torch.long), None, match)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        pass


class NGramDrafter:
    """Unigram (order=1) or bigram (order=2) token model, fitted from token ids and updated online
    from the context it drafts for. Draft logits are log-probabilities of an add-`smoothing` model
    (bigram backs off to the unigram), warped exactly like the target's before sampling."""

    def __init__(self, vocab_size: int, order: int = 2, smoothing: float = 0.1):
        if order not in (1, 2):
            raise ValueError("order must be 1 (unigram) or 2 (bigram)")
        self.vocab_size, self.order, self.smoothing = vocab_size, order, smoothing
        self.name = "unigram" if order == 1 else "bigram"
        self.unigram = torch.zeros(vocab_size)  # [V] counts
        self.bigram: dict[int, Counter] = defaultdict(Counter)
        self._n_seen = 0  # tokens of the current context already counted
        self.copies = False

    def fit(self, token_ids: list[int]) -> "NGramDrafter":
        """Add the counts of a token sequence (e.g. text the target generated)."""
        for a, b in zip(token_ids, token_ids[1:]):
            self.bigram[a][b] += 1
        if token_ids:
            self.unigram += torch.bincount(torch.tensor(token_ids), minlength=self.vocab_size)[: self.vocab_size]
        return self

    def _update(self, context: list[int]) -> None:
        """Count the part of the (only ever growing) context not counted yet."""
        start = max(self._n_seen - 1, 0)  # re-include the last counted token to get its pair
        self.fit(context[start:])
        if self._n_seen:
            self.unigram[context[start]] -= 1  # ... but not its unigram count twice
        self._n_seen = len(context)

    def logits(self, prev: int) -> torch.Tensor:
        """[V] log-probabilities of the next token after `prev`."""
        uni = (self.unigram + self.smoothing) / (self.unigram.sum() + self.smoothing * self.vocab_size)
        if self.order == 1:
            return uni.log()
        row = self.bigram.get(prev)
        counts = torch.zeros(self.vocab_size)
        if row:
            counts[list(row.keys())] = torch.tensor(list(row.values()), dtype=torch.float)
        return ((counts + uni) / (counts.sum() + 1.0)).log()

    def propose(self, context, k, params: SamplingParams, generator, law=None) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        self._update(context)
        prev, ids, probs = context[-1], [], []
        for _ in range(k):
            logits = self.logits(prev)
            q = warp(logits, params) if law is None else law.draft_probs(logits, context + ids)  # [V]
            prev = sample(q, generator)
            ids.append(prev)
            probs.append(q)
        return Proposal(torch.tensor(ids, dtype=torch.long), torch.stack(probs))

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        pass
