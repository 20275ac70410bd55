"""The causal-LM adapter interface the decode loop talks to.

An adapter owns its KV cache: `forward` appends new tokens and returns logits for every one of them
(one pass, so verifying γ drafts costs one call), `prefill` appends without logits, `truncate` rolls the cache back to an earlier length
(rejected drafts are forgotten by a length change, not a copy).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    eos_token_ids: set[int]
    max_length: int  # context window in tokens

    @property
    def length(self) -> int:
        """Number of tokens currently held in the KV cache."""
        ...

    def reset(self) -> None:
        """Forget every cached token."""
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
