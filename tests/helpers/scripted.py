"""A drafter that proposes a script of tokens (loop tests: what is drafted is known in advance)."""

from __future__ import annotations

import torch

from exactspec.speculative.interfaces import Proposal


class Scripted:
    """A drafter that proposes a fixed list each time (to force acceptance patterns)."""

    name = "scripted"

    def __init__(self, make):
        self.make, self.calls = make, 0

    def propose(self, context, k, params, generator):
        self.calls += 1
        ids = self.make(context)[:k]
        return Proposal(torch.tensor(ids, dtype=torch.long), None)

    def observe(self, num_proposed, num_accepted):
        pass
