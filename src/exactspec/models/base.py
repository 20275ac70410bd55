"""The batch methods for adapters whose cache holds one sequence (see speculative/interfaces.py: CausalLM)."""

from __future__ import annotations

import torch

from ..errors import ExactSpecError
from ..speculative.prefix_cache import prefill_prompt


class OneRow:
    """The batch methods of `CausalLM` for an adapter whose cache holds one sequence (B <= 1), on top of
    its own reset / forward / prefill / truncate. Subclasses call `_set_rows(batch)` in their `reset`."""

    batched = False
    identity = ""  # not self-tested at load (the torch loader sets it where it ran the layout self-test)
    cost_key: str | None = None  # set by the loader: keys auto γ's cached T(k)
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

    def append_rows(self, prompt_ids: list[int], copies: int = 1) -> int:
        """The one row, holding prompt_ids[:-1] (through the prefix cache, if any) -> tokens reused."""
        if not prompt_ids or len(prompt_ids) >= self.max_length:
            raise ExactSpecError(f"a prompt of {len(prompt_ids)} tokens cannot join a {self.max_length}-token context")
        self._set_rows(self._rows + copies)
        return prefill_prompt(self, prompt_ids[:-1])
