"""Model-free drafters: unigram / bigram (paper Table 3). Prompt lookup copies: see suffix.py."""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from ..speculative.sampling import SamplingParams, sample, warp
from ..speculative.interfaces import Proposal


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
