"""The small pieces every tool-call syntax is built from: Lark literals (with a vocabulary's special
tokens as their tokens), regex literals, schema rebasing, how much of a text may still open a marker,
and where a JSON value ends."""

from __future__ import annotations

import json
import re


def lark_literal(text: str, tokens: dict[str, int] | None = None) -> str:
    """`text` as Lark: a string literal, with each of `tokens`' texts in it as its token (`<[id]>`)."""
    if not tokens:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")", text)
    return " ".join(f"<[{tokens[p]}]>" if p in tokens else json.dumps(p) for p in pieces if p)


def regex_literal(text: str) -> str:
    """`text` as a literal inside a /regex/ of a Lark grammar."""
    return "".join("\\" + c if c in r"\/.^$*+?()[]{}|&~-" else ("\\n" if c == "\n" else c) for c in text)


def rebase(schema, base: str):
    """`schema` with local references ("#", "#/$defs/X") rewritten to point below `base`, a JSON pointer to
    where it is embedded, so `$defs` keep working inside a larger schema."""
    if isinstance(schema, list):
        return [rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: rebase(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `marker` (held back: they may open it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ValueEnd:
    """Where a JSON value ends, found incrementally (strings and nesting tracked across calls)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.begun = 0, False, False, False

    def feed(self, text: str, i: int) -> int:
        """Scan text[i:] (the value began at or before i); the index just past the value, or -1."""
        for i in range(i, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = self.begun = True
            elif c in "{[":
                self.depth += 1
                self.begun = True
            elif c in "}]":
                if self.depth == 0:  # the end of a scalar: the enclosing object closes
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif c == "," and self.depth == 0 and self.begun:
                return i
            elif not c.isspace():
                self.begun = True
        return -1


class CallReading:
    """What every family's call reader shares over its `text` (the output so far), `sent` (characters
    handed out), `begin` (where the calls begin, None until known) and `calls` (those begun)."""

    text: str
    sent: int
    begin: int | None
    calls: list

    @property
    def started(self) -> bool:
        return bool(self.calls)

    def content(self) -> str | None:
        """The text before the calls (None when there is none but whitespace)."""
        text = self.text if self.begin is None else self.text[:self.begin]
        return text if text.strip() else None

    def flush(self) -> list[tuple[str, str]]:
        """At the end of the output: held text that never became a call, as content."""
        if self.calls or self.sent >= len(self.text):
            return []
        held, self.sent = self.text[self.sent:], len(self.text)
        return [("content", held)]
