"""Incremental detokenisation: the text of a growing list of generated tokens, and where a stop string
first occurs in it, at a cost per new token that does not grow with the length of the generation.

Re-decoding every generated token at every step (what `tokenizer.decode(all_ids)` per token does) is
quadratic in the output length. Here only a short window is decoded per step (vLLM's / HF
TextStreamer's scheme): the tokens of the last committed piece (context for tokenizers whose decoding
depends on the neighbour, e.g. SentencePiece's leading-space rule) plus the new ones. A piece is
committed once it ends on a complete character; a trailing partial UTF-8 sequence stays pending (it
decodes to U+FFFD until the rest of its bytes arrive). `text` is always exactly
`tokenizer.decode(ids, skip_special_tokens=True)` (with the text of the `shown` special tokens kept): tokenizers whose decoding rewrites text across token
boundaries (`clean_up_tokenization_spaces`) are decoded whole, as before, because no window is exact for them.
Stop strings are searched only in text not yet searched (minus the longest stop's length), and the
text held back because it might start one is found in O(len(stop)) per token (a KMP automaton run over
the last len(stop) - 1 characters), not O(len(stop)²).
`tokens_within(n)` says how many tokens have their whole text in the first n characters (which
tokens a streamed piece of text carries: the server sends their logprobs with it).
"""

from __future__ import annotations

from bisect import bisect_right


class IncrementalText:
    """Text of `ids` (fed one token at a time with `add`) and the first stop-string hit in it."""

    def __init__(self, tokenizer, stops: list[str] | None = None, shown: dict[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.shown = shown or {}  # special tokens whose text is kept (a tool family's marker token) -> that text
        self.stops = [s for s in (stops or []) if s]
        self._failure = [_failure(s) for s in self.stops]
        self.ids: list[int] = []
        self.whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.committed = ""  # text of ids[:read]; ends on a complete character
        self.pending = ""  # text of ids[read:] (may end in U+FFFD: bytes still to come)
        self.prefix, self.read = 0, 0  # ids[prefix:read]: the last committed piece, decoded again as context
        self.scanned = 0  # committed characters already searched for stop strings
        self.stop_at = -1  # index of the first stop-string hit in `text`, -1 if none
        self.ends: list[int] = []  # ends[i]: len(text) once token i's text is complete (no partial character)
        self.decoded_chars = 0  # characters produced by tokenizer.decode (the cost the tests bound)
        self.scanned_chars = 0  # characters searched for stop strings

    @property
    def text(self) -> str:
        return self.committed + self.pending

    def _decode(self, ids: list[int]) -> str:
        out, start = "", 0
        for i, token in enumerate(ids if self.shown else ()):
            if token in self.shown:
                out += self.tokenizer.decode(ids[start:i], skip_special_tokens=True) + self.shown[token]
                start = i + 1
        out += self.tokenizer.decode(ids[start:], skip_special_tokens=True)
        self.decoded_chars += len(out)
        return out

    def add(self, token: int) -> None:
        self.ids.append(token)
        if self.whole:
            self.committed, self.pending = "", self._decode(self.ids)
        else:
            before = self._decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
            window = self._decode(self.ids[self.prefix:])
            if not window.startswith(before):  # never seen with byte-level or SentencePiece decoders
                self.committed, self.pending = "", self._decode(self.ids)
                self.prefix = self.read = 0
                self.whole = True
            else:
                self.pending = window[len(before):]
                if self.pending and not self.pending.endswith("\ufffd"):
                    self.committed += self.pending
                    self.pending = ""
                    self.prefix, self.read = self.read, len(self.ids)
        if not self.pending.endswith("\ufffd") and len(self.text) > (self.ends[-1] if self.ends else 0):
            self.ends += [len(self.text)] * (len(self.ids) - len(self.ends))  # tokens since the last complete character
        if self.stops and self.stop_at < 0:
            self._find_stop()

    def tokens_within(self, length: int) -> int:
        """How many of `ids` (a prefix) have their whole text within `text[:length]`. Tokens that add no
        text (EOS, skipped special tokens) count with the text after them, so trailing ones not at all;
        a trailing partial character counts once `length` covers it (the final flush of a cut output)."""
        if length >= len(self.text) and self.pending.endswith("\ufffd"):
            return len(self.ids)
        return bisect_right(self.ends, length)

    def _find_stop(self) -> None:
        text = self.text
        longest = max(len(s) for s in self.stops)
        start = max(0, min(self.scanned, len(self.committed)) - longest + 1) if not self.whole else 0
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        self.scanned_chars += len(text) - start
        self.scanned = len(self.committed)
        if hits:
            self.stop_at = min(hits)

    def safe_length(self, final: bool) -> int:
        """Characters of `text` safe to send: everything if `final`, else no trailing partial character
        and nothing that might be the start of a stop string (up to the first hit, if any)."""
        text = self.text
        if self.stop_at >= 0:
            return self.stop_at
        if final:
            return len(text)
        end = len(text) - text.endswith("\ufffd")
        hold = max((_overlap(text, end, s, f) for s, f in zip(self.stops, self._failure)), default=0)
        return end - hold


def _failure(stop: str) -> list[int]:
    """KMP's failure function: f[i] = the length of the longest proper prefix of stop[:i + 1] that is
    also its suffix."""
    f, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = f[k - 1]
        if stop[i] == stop[k]:
            k += 1
        f[i] = k
    return f


def _overlap(text: str, end: int, stop: str, failure: list[int]) -> int:
    """The length of the longest proper prefix of `stop` that `text[:end]` ends with, in
    O(len(stop)): the automaton reads only the last len(stop) - 1 characters."""
    k = 0
    for c in text[max(0, end - len(stop) + 1):end]:
        while k and (k == len(stop) or stop[k] != c):
            k = failure[k - 1]
        if stop[k] == c:
            k += 1
    return min(k, len(stop) - 1)
