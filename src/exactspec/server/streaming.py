"""One choice of a streamed response: the worker's pieces -> OpenAI stream chunks.

Text goes out as the detokeniser releases it. The logprob entries of a piece's tokens ride on the
chunk that carries the piece's text; when a piece sends nothing (a tool call's head still being read)
or a token's text is never sent (EOS, the tokens of a stop string), its entries ride on the choice's
next chunk, at the latest the one with `finish_reason`. So the streamed entries, concatenated, are the
non-streamed response's list, in order.

Tool requests are read by their plan's reader (`tools.CallReader`, or a tool family's
`families.CallsReader`, whose parallel calls take indexes 0, 1, ...): a call starts with a chunk that names it
(`{"index": 0, "id", "type": "function", "function": {"name", "arguments": ""}}`), then its arguments
stream as `{"index": 0, "function": {"arguments": fragment}}` deltas, and `finish_reason` is
"tool_calls". A call cut short (max_tokens, or a stop string) stays a call in the stream -- its
deltas are already out -- and ends with that finish_reason ("length" / "stop"), its arguments
incomplete JSON; a non-streamed response returns the same output as `content` instead. Output that
never became a call (auto's text, a head cut before its name was complete) streams as content.
"""

from __future__ import annotations

from ..engine import GenerationResult
from .shapes import Shapes
from .worker import Piece


class StreamedChoice:
    """The chunks of choice `index`: `start`, then `piece` per Piece, then `finish` once it is complete."""

    def __init__(self, shapes: Shapes, index: int) -> None:
        self.shapes, self.index = shapes, index
        self.reader = shapes.tools.reader() if shapes.tools is not None else None
        self.calls = 0  # tool calls begun (a family's parallel calls stream with index 0, 1, ...)
        self.entries: list[dict] = []  # logprob entries not sent yet
        self.offset = 0  # completions: text_offset of the next entry

    def start(self) -> list[dict]:
        return [self.shapes.chunk(self.index, first=True)]

    def piece(self, piece: Piece) -> list[dict]:
        self.entries += piece.logprobs or []
        if self.reader is not None:
            return self._chunks(self.reader.feed(piece.text))
        return self._chunks([("content", piece.text)] if piece.text else [])

    def finish(self, result: GenerationResult) -> list[dict]:
        reason = result.finish_reason
        chunks = []
        if self.reader is not None:
            chunks = self._chunks(self.reader.flush())
            if self.reader.started and reason == "stop" and self.reader.complete():
                reason = "tool_calls"
        return chunks + [self.shapes.chunk(self.index, finish_reason=reason, logprobs=self._take())]

    def _chunks(self, deltas: list[tuple[str, str]]) -> list[dict]:
        """A chunk per CallReader delta; the pending logprob entries ride on the last one."""
        chunks = []
        for i, (kind, text) in enumerate(deltas):
            logprobs = self._take() if i == len(deltas) - 1 else None
            if kind == "content":
                chunks.append(self.shapes.chunk(self.index, text, logprobs=logprobs))
            else:
                if kind == "call":
                    self.calls += 1
                    call = {"index": self.calls - 1, "id": self.shapes.tools.call_id(), "type": "function",
                            "function": {"name": text, "arguments": ""}}
                else:
                    call = {"index": self.calls - 1, "function": {"arguments": text}}
                chunks.append(self.shapes.chunk(self.index, logprobs=logprobs, tool_call=call))
        return chunks

    def _take(self) -> dict | None:
        """The pending entries as OpenAI's logprobs object (None when there are none)."""
        if not self.entries or self.shapes.token_text is None:
            return None
        lp = self.shapes.logprob_object(self.entries, self.offset)
        if not self.shapes.chat:
            self.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        self.entries = []
        return lp
