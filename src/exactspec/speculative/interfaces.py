"""The two interfaces the decode loop talks to: the target model's adapter (`CausalLM`) and the drafter.

CausalLM. An adapter owns its KV cache: `forward` appends new tokens and returns logits for every one
of them (one pass, so verifying γ drafts costs one call), `prefill` appends without logits, `truncate`
rolls the cache back to an earlier length (rejected drafts are forgotten by a length change, not a
copy). The loop (speculative/loop.py) runs every generation as a batch of rows, so it talks to the batch
methods: `forward_rows`, `truncate_rows`, `select_rows`, `reset(batch)`, `append_rows`. An adapter whose
cache holds one sequence (transformers, encoder-decoder, a one-row llama.cpp context) inherits them from
`models.base.OneRow`, or refuses a second row (llama.cpp): a batch of at most one row, so B = 1 needs no
special case in the loop. `batched` says which kind an adapter is (batching.py decodes one-row adapters'
requests one after another); models/fast_llama.py and a llama.cpp context of several rows are batched.

Drafter: propose up to k tokens (with the law they were drawn from), then hear the outcome.
Drafters never see the target model. The verifier only needs each proposed token and the draft
probabilities it was sampled from (or none, for deterministic point-mass proposals such as prompt
lookup). A drafter with nothing to propose returns an empty proposal and the loop takes a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .sampling import SamplingParams


_NO_IDS: tuple[int, ...] = ()  # no tokens (not a tensor: every step asks its length)


@dataclass
class Proposal:
    ids: torch.Tensor | list[int] | tuple[int, ...]  # [k] long (k may be 0); a copy may give a list (see tokens)
    probs: torch.Tensor | None  # [k, V] warped draft probs, or None for point masses
    match: int = 0  # copying drafters: context tokens before the proposal that agree with its source

    @classmethod
    def empty(cls) -> "Proposal":
        return _EMPTY  # shared: no one writes into a proposal

    def tokens(self) -> list[int]:
        """The proposed ids as a list. Copies hand theirs over as lists: the loop reads lists, and the
        first torch call after a target pass cost ~60 us here (every step drafts)."""
        return self.ids.tolist() if isinstance(self.ids, torch.Tensor) else list(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


_EMPTY = Proposal(_NO_IDS, None)


class Drafter(Protocol):
    name: str
    copies: bool  # True: proposals are copies with a match length; auto γ may cut them to any prefix

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None, law=None
    ) -> Proposal:
        """Up to k tokens to follow `context` (prompt + everything emitted so far). A stochastic drafter
        given `law` (law.TargetLaw: grammar mask, penalties) samples from
        `law.draft_probs(logits, context + drafts so far)` instead of `warp(logits, params)`."""
        ...

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """Outcome of the last proposal; drafters may adapt. Default drafters ignore it."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    eos_token_ids: set[int]
    max_length: int  # context window in tokens
    batched: bool  # the cache holds many rows (False: at most one, see OneRow)

    @property
    def length(self) -> int:
        """Number of tokens currently held in the KV cache (row 0's)."""
        ...

    def reset(self, batch: int = 1) -> None:
        """Forget every cached token; the cache then holds `batch` empty rows."""
        ...

    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        """new_ids [1, k] appended to the cache -> logits [1, k, V] (float32)."""
        ...

    def prefill(self, new_ids: torch.Tensor) -> None:
        """Like `forward`, but computes no logits: for prompt tokens whose logits nobody reads (the
        output projection over V is a large share of a prefill on small models)."""
        ...

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        ...

    # --- the batch methods (the decode loop's) ---------------------------------------------------
    def forward_rows(self, new_ids: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """new_ids [B, k]: every row appends k positions at its own length -> logits [B, k, V] (or None)."""
        ...

    def truncate_rows(self, lengths: list[int] | torch.Tensor) -> None:
        """lengths [B]: keep the first lengths[b] positions of each row."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the given rows [B'], in that order."""
        ...

    def append_rows(self, prompt_ids: list[int], copies: int = 1) -> int:
        """Append `copies` rows holding prompt_ids[:-1] (through the prefix cache, if any) -> tokens reused."""
        ...
