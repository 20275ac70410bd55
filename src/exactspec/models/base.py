"""The causal-LM adapter interface the decode loop talks to.

An adapter owns its KV cache: `forward` appends new tokens and returns logits for every one of them
(one pass, so verifying γ drafts costs one call), `prefill` appends without logits, `truncate` rolls the cache back to an earlier length
(rejected drafts are forgotten by a length change, not a copy).

The decode loop (decode_batch.py) runs every generation as a batch of rows, so it talks to the batch
methods: `forward_rows`, `truncate_rows`, `select_rows`, `reset(batch)`, `join`. An adapter whose cache
holds one sequence (transformers, encoder-decoder, llama.cpp) inherits them from `OneRow`: a batch of
at most one row, so B = 1 needs no special case in the loop. `batched` says which kind an adapter is
(the server and `Engine.generate_batch` decode one-row adapters' requests one after another).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..errors import ExactSpecError
from .prefix_cache import prefill_prompt


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

    def join(self, prompt_ids: list[int], copies: int = 1) -> int:
        """Append `copies` rows holding prompt_ids[:-1] (through the prefix cache, if any) -> tokens reused."""
        ...


class OneRow:
    """The batch methods of `CausalLM` for an adapter whose cache holds one sequence (B <= 1), on top of
    its own reset / forward / prefill / truncate. Subclasses call `_set_rows(batch)` in their `reset`."""

    batched = False
    _rows = 1

    @property
    def batch_size(self) -> int:
        return self._rows

    def _set_rows(self, batch: int) -> None:
        if batch > 1:
            raise ExactSpecError(f"{type(self).__name__} holds one sequence: decode its rows one at a time")
        self._rows = batch

    def forward_rows(self, new_ids: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """new_ids [1, k] -> logits [1, k, V] (None if not `logits`)."""
        if new_ids.shape[0] != self._rows:
            raise ValueError(f"got {new_ids.shape[0]} rows for a cache of {self._rows}")
        if not logits:
            return self.prefill(new_ids)
        return self.forward(new_ids)

    def truncate_rows(self, lengths: list[int] | torch.Tensor) -> None:
        if len(lengths):
            self.truncate(int(lengths[0]))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep row 0 ([0]) or none ([]): the only selections a one-row cache has."""
        if len(rows) > 1 or (len(rows) == 1 and int(rows[0]) != 0):
            self._set_rows(2)  # refused with the one-sequence message
        self._rows = len(rows)

    def join(self, prompt_ids: list[int], copies: int = 1) -> int:
        """The one row, holding prompt_ids[:-1] (through the prefix cache, if any) -> tokens reused."""
        if not prompt_ids or len(prompt_ids) >= self.max_length:
            raise ExactSpecError(f"a prompt of {len(prompt_ids)} tokens cannot join a {self.max_length}-token context")
        self._set_rows(self._rows + copies)
        return prefill_prompt(self, prompt_ids[:-1])
