"""Does a Lark grammar derive any finite string? (`start: a` / `a: "x" a` does not.)

llguidance compiles such a grammar and its matcher happily allows "x", "xx", ... forever: the
constraint can never be satisfied, and a request with it would only fail once its token budget ran
out. This is the classic productive-symbol fixpoint: a rule (or terminal) is productive if one of its
alternatives consists only of literals and productive names; an item under `*`, `?`, `[...]` or
`~ 0..n` needs nothing. The grammar has a finite derivation iff `start` is productive.

The analysis reads llguidance's Lark dialect only as far as it is sure of it (rules and terminals,
`?`/`!` prefixes, priorities, `[attributes]`, strings, regexes, `"a".."z"` ranges, groups, `* + ? ~`,
`->` aliases, `%import`, `%ignore`, `%declare`, `%llguidance {...}`, inline `%json {...}` /
`%regex {...}`, special tokens `<...>`, `@grammar` references). On anything else (templates,
`%override`, `&`, ...) it answers "don't know", and the grammar is left to llguidance: it never
refuses a grammar it did not fully understand. Linear in the grammar's size (counters, no passes).
"""

from __future__ import annotations

import json
import re

_TOKEN = re.compile(r"""
    (?P<skip>[ \t\f\r]+|//[^\n]*|\\\r?\n)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><[^<>\n]*>)
  | (?P<ref>@[A-Za-z0-9_\-]+)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<number>-?(?:0x[0-9A-Fa-f]+|[0-9]+))
  | (?P<op>->|\.\.|::|[:|()\[\]{}*+?~,=.!])
""", re.VERBOSE)
_JSON = json.JSONDecoder()
_MAX_NESTING = 200  # groups inside groups; deeper: don't know


class _Unsure(Exception):
    """The grammar uses something this analysis does not read: no verdict."""


def nonterminating(text: str) -> list[str]:
    """The rules reachable from `start` that derive no finite string, `start` first; [] when `start`
    derives one, or when the grammar is beyond this analysis (see the module docstring)."""
    try:
        rules, external = _Parser(_tokens(text)).parse()
    except (_Unsure, RecursionError):
        return []
    if "start" not in rules:
        return []
    productive = _productive(rules, external)
    if "start" in productive:
        return []
    seen, order = {"start"}, ["start"]
    for name in order:  # breadth-first over the references of the unproductive rules
        for ref in _names(rules[name]):
            if ref in rules and ref not in productive and ref not in seen:
                seen.add(ref)
                order.append(ref)
    return order


# --- tokens ---------------------------------------------------------------------------------------

def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs; `%json {...}` / `%regex {...}` become one "atom", `%llguidance {...}` one
    "options" token (their JSON read by a JSON decoder)."""
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unsure
        kind, value, pos = m.lastgroup, m.group(), m.end()
        if kind == "skip":
            continue
        if kind == "directive" and value in ("%json", "%regex", "%llguidance"):
            while pos < len(text) and text[pos] in " \t":
                pos += 1
            try:
                _, pos = _JSON.raw_decode(text, pos)
            except ValueError:
                raise _Unsure from None
            kind = "options" if value == "%llguidance" else "atom"
        out.append((kind, value))
    out.append(("nl", "\n"))
    return out


# --- statements and expressions -------------------------------------------------------------------
# An expression is True (derives a finite string whatever else holds), a name, or ("or" | "and", [parts]).

class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.i = tokens, 0
        self.rules: dict[str, object] = {}
        self.external: set[str] = set()  # imported or declared: taken as productive

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        self.i += 1
        return token

    def expect(self, value: str) -> None:
        if self.take()[1] != value:
            raise _Unsure

    def parse(self) -> tuple[dict[str, object], set[str]]:
        while self.peek()[0] != "end":
            kind, value = self.peek()
            if kind == "nl":
                self.i += 1
            elif kind == "options":
                self.i += 1
            elif kind == "directive":
                self.directive(value)
            else:
                self.rule()
        return self.rules, self.external

    def directive(self, value: str) -> None:
        if value not in ("%import", "%ignore", "%declare"):
            raise _Unsure  # %override, %extend, %if, ...: no verdict
        self.i += 1
        while self.peek()[0] not in ("nl", "end"):
            kind, name = self.take()
            if kind == "name" and value != "%ignore":
                self.external.add(name)

    def rule(self) -> None:
        if self.peek()[1] in ("?", "!"):
            self.i += 1
        kind, name = self.take()
        if kind != "name":
            raise _Unsure
        if self.peek()[1] == ".":  # priority
            self.i += 1
            if self.take()[0] != "number":
                raise _Unsure
        if self.peek()[1] == "[":  # llguidance attributes: [max_tokens=5, lazy, stop="..."]
            while self.take()[1] != "]":
                if self.peek()[0] in ("nl", "end"):
                    raise _Unsure
        self.expect(":")  # a template (`name{x}:`) or anything else lands here
        body = self.alternatives(0)
        if self.peek()[0] not in ("nl", "end"):
            raise _Unsure
        self.rules[name] = _or([self.rules[name], body]) if name in self.rules else body

    def skip_continuation_lines(self, depth: int) -> None:
        """Newlines inside a group, or before a `|` that continues the rule, are not its end."""
        j = self.i
        while j < len(self.tokens) and self.tokens[j][0] == "nl":
            j += 1
        if j > self.i and (depth > 0 or (j < len(self.tokens) and self.tokens[j][1] == "|")):
            self.i = j

    def alternatives(self, depth: int):
        if depth > _MAX_NESTING:
            raise _Unsure
        options = []
        while True:
            self.skip_continuation_lines(depth)
            options.append(self.sequence(depth))
            self.skip_continuation_lines(depth)
            if self.peek()[1] != "|":
                return _or(options)
            self.i += 1

    def sequence(self, depth: int):
        items = []
        while True:
            if depth > 0:
                self.skip_continuation_lines(depth)
            kind, value = self.peek()
            if kind in ("nl", "end") or value in ("|", ")", "]"):
                return _and(items)
            if value == "->":  # an alias names the tree node: not a reference
                self.i += 1
                if self.take()[0] != "name":
                    raise _Unsure
                continue
            items.append(self.item(depth))

    def item(self, depth: int):
        kind, value = self.take()
        if value == "(":
            atom = self.alternatives(depth + 1)
            self.expect(")")
        elif value == "[":
            self.alternatives(depth + 1)  # read for syntax; optional whatever it holds
            self.expect("]")
            atom = True
        elif kind == "string":
            atom = True
            if self.peek()[1] == "..":  # "a".."z"
                self.i += 1
                if self.take()[0] != "string":
                    raise _Unsure
        elif kind in ("regex", "special", "ref", "atom"):
            atom = True
        elif kind == "name":
            if self.peek()[1] == "{":  # a template's use
                raise _Unsure
            atom = value
        else:
            raise _Unsure
        value = self.peek()[1]
        if value in ("*", "?"):
            self.i += 1
            return True
        if value == "+":
            self.i += 1
            return atom
        if value == "~":
            self.i += 1
            kind, low = self.take()
            if kind != "number":
                raise _Unsure
            if self.peek()[1] == "..":
                self.i += 1
                if self.take()[0] != "number":
                    raise _Unsure
            return True if int(low, 0) == 0 else atom
        return atom


def _or(parts: list):
    if any(part is True for part in parts):
        return True
    return parts[0] if len(parts) == 1 else ("or", parts)


def _and(parts: list):
    parts = [part for part in parts if part is not True]
    if not parts:
        return True
    return parts[0] if len(parts) == 1 else ("and", parts)


def _names(expr) -> list[str]:
    out, stack = [], [expr]
    while stack:
        expr = stack.pop()
        if isinstance(expr, str):
            out.append(expr)
        elif isinstance(expr, tuple):
            stack.extend(reversed(expr[1]))
    return out


# --- the fixpoint ---------------------------------------------------------------------------------

class _Node:
    __slots__ = ("kind", "parent", "waiting", "done", "rule")

    def __init__(self, kind: str, parent: _Node | None, waiting: int, rule: str | None) -> None:
        self.kind, self.parent, self.waiting, self.done, self.rule = kind, parent, waiting, False, rule


def _productive(rules: dict[str, object], external: set[str]) -> set[str]:
    """The productive names, by counters: an "and" node waits for all its parts, an "or" node for one;
    each name's occurrences are leaves that fire once the name is known productive."""
    productive: set[str] = set()
    queue: list[str] = []
    leaves: dict[str, list[_Node]] = {}

    def build(expr, parent: _Node | None, rule: str | None) -> None:
        if expr is True or (isinstance(expr, str) and (expr in external or expr not in rules)):
            # an undefined name is llguidance's error to report, not ours
            return fire(_Node("leaf", parent, 0, rule))
        if isinstance(expr, str):
            leaves.setdefault(expr, []).append(_Node("leaf", parent, 1, rule))
            return
        kind, parts = expr
        node = _Node(kind, parent, len(parts) if kind == "and" else 1, rule)
        for part in parts:
            build(part, node, None)

    def fire(node: _Node | None) -> None:
        while node is not None and not node.done:
            node.waiting -= 1
            if node.waiting > 0 and node.kind == "and":
                return
            node.done = True
            if node.parent is None:
                if node.rule not in productive:
                    productive.add(node.rule)
                    queue.append(node.rule)
                return
            node = node.parent

    for name, body in rules.items():
        build(body, None, name)
    while queue:
        for leaf in leaves.pop(queue.pop(), []):
            fire(leaf)
    return productive
