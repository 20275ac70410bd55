"""A smaller causal LM as drafter. It keeps its own KV cache in step with the context by rolling back
to the longest common prefix before each proposal (rejected drafts vanish by a length change)."""

from __future__ import annotations

import torch

from ..speculative.interfaces import CausalLM
from ..speculative.sampling import sample, warp
from ..speculative.interfaces import Proposal


class ModelDrafter:
    name = "model"
    copies = False

    def __init__(self, model: CausalLM):
        self.model = model
        self.cached: list[int] = []  # tokens whose KV the draft model holds
        self.model.reset()

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Bring the cache to context[:-1] plus the last token; -> logits [V] for the next token."""
        common = 0
        limit = min(len(self.cached), len(context) - 1)  # always re-feed at least one token
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.model.truncate(common)
        logits = self.model.forward(torch.tensor([context[common:]], dtype=torch.long))[0, -1]
        self.cached = list(context)
        return logits

    def propose(self, context, k, params, generator, law=None) -> Proposal:
        if k <= 0:
            return Proposal.empty()
        k = min(k, self.model.max_length - len(context))
        if k <= 0:
            return Proposal.empty()
        logits = self._sync(context)
        ids, probs = [], []
        for i in range(k):
            q = warp(logits, params) if law is None else law.draft_probs(logits, context + ids)  # [V]
            token = sample(q, generator)
            ids.append(token)
            probs.append(q)
            if i + 1 < k:
                logits = self.model.forward(torch.tensor([[token]]))[0, -1]
                self.cached.append(token)
        return Proposal(torch.tensor(ids, dtype=torch.long), torch.stack(probs))

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        pass
