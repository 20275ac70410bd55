"""A target whose greedy answers are a script: each answer is chosen by what the conversation before it
holds, and written token by token as the script's text says (the server's grammar may force tokens of
its own choosing: the next token is read off the text still to write, not off a fixed list of ids).

It is a real `CausalLM` (models.base.OneRow: a one-row cache of ids, truncated and reset as any
adapter's) under a real tokenizer and chat template, so the real server, doors, grammar and drafters
run on it; only the numbers are scripted. For agent-CLI sessions whose tool calls must be known."""

from __future__ import annotations

from typing import Callable

import torch

from exactspec.models.base import OneRow


class ScriptedTarget(OneRow):
    """`answer(history)` -> the text of the next answer, where `history` is the decoded conversation
    before the last answer header `header` (e.g. "<|im_start|>assistant\\n"). Logits put 0 on the next
    token of that text (after what the answer holds so far) or on end-of-turn once it is written, and
    -30 everywhere else: greedy and any warp pick the script."""

    def __init__(self, tokenizer, answer: Callable[[str], str], header: str, max_length: int = 65536) -> None:
        self.tokenizer, self.answer = tokenizer, answer
        self.header = tokenizer.encode(header, add_special_tokens=False)
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = {tokenizer.eos_token_id}
        self.max_length = max_length
        self.ids: list[int] = []
        self.histories: list[str] = []  # each answer's history, in the order first asked

    @property
    def length(self) -> int:
        return len(self.ids)

    def reset(self, batch: int = 1) -> None:
        self._set_rows(batch)
        self.ids = []

    def truncate(self, length: int) -> None:
        del self.ids[length:]

    def prefill(self, new_ids: torch.Tensor) -> None:
        self.ids.extend(new_ids[0].tolist())

    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        out = torch.full((1, new_ids.shape[1], self.vocab_size), -30.0)
        for i, token in enumerate(new_ids[0].tolist()):
            self.ids.append(token)
            out[0, i, self.next_token()] = 0.0
        return out

    def next_token(self) -> int:
        start = self._answer_start()
        if start is None:
            return next(iter(self.eos_token_ids))
        history = self.tokenizer.decode(self.ids[:start - len(self.header)])
        if not self.histories or self.histories[-1] != history:
            self.histories.append(history)
        script = self.answer(history)
        written = self.tokenizer.decode(self.ids[start:])
        if not script.startswith(written) or written == script:
            return next(iter(self.eos_token_ids))
        return self.tokenizer.encode(script[len(written):], add_special_tokens=False)[0]

    def _answer_start(self) -> int | None:
        """Where the last answer begins: just after the last `header` in the cache."""
        n = len(self.header)
        for at in range(len(self.ids) - n, -1, -1):
            if self.ids[at:at + n] == self.header:
                return at + n
        return None
