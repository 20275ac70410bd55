"""The server's limits on what one request may ask for, and the checks that enforce them.

One request must never take the server down or starve its neighbours, so everything whose cost grows
with the request is bounded here, in one place, before any token is generated:

    body           MAX_BODY_BYTES while it is read (chunked bodies too)        -> 413 request_too_large
    stop strings   at most MAX_STOPS, each at most MAX_STOP_CHARS characters    -> 400, param "stop"
    JSON schemas   nesting + $ref chains at most MAX_SCHEMA_DEPTH levels     -> 400, param "response_format" / "tools"
    constraints    schema / grammar / regex text at most MAX_CONSTRAINT_BYTES    -> 400
    Lark grammars  at most MAX_GRAMMAR_RULES rules                              -> 400
    logit_bias     keys are ASCII decimal token ids ("²", "--5", "٣" are not)    -> 400, param "logit_bias"
    messages       at most MAX_MESSAGES (schemas.py), tools at most MAX_TOOLS   -> 400

Each message names the bound it broke. Compilation itself runs on a thread with a large stack
(see offload.py), so a grammar just inside the bounds cannot overflow a native stack either.
"""

from __future__ import annotations

import json
import re

from ..errors import FieldError

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024
MAX_SCHEMA_DEPTH = 128  # levels of the schema document: objects, arrays and $ref hops
MAX_CONSTRAINT_BYTES = 256 * 1024
MAX_GRAMMAR_RULES = 1000
MAX_TOOLS = 128
MAX_MESSAGES = 10_000  # validated on the event loop (pydantic), so bounded: 10^5 messages stalled it

_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z_0-9]*(\{[^}]*\})?(\.-?\d+)?\s*:", re.MULTILINE)


class LimitError(FieldError):
    """A request beyond one of the server's limits; `param` names the request field."""


def check_stops(stops: list[str]) -> None:
    """At most MAX_STOPS stop strings of at most MAX_STOP_CHARS characters each."""
    if len(stops) > MAX_STOPS:
        raise LimitError(f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise LimitError(f"stop: a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}", "stop")


def check_constraint(spec: dict | None, param: str) -> None:
    """Size, depth and rule-count bounds of a constraint spec (OpenAI response_format or the regex /
    grammar extensions), checked before llguidance sees it."""
    if not isinstance(spec, dict):
        return
    kind = spec.get("type")
    if kind in ("grammar", "lark", "regex"):
        text = spec.get("grammar", spec.get("lark")) if kind != "regex" else spec.get("regex")
        if isinstance(text, str):
            _check_size(len(text.encode()), f"the {kind if kind != 'lark' else 'grammar'}", param)
            if kind != "regex":
                check_lark(text, param)
        for sub in (spec.get("subgrammars") or {}).values():  # free-form tools' grammars (tools.plan_tools)
            check_constraint(sub, param)
    elif kind == "json_schema":
        inner = spec.get("json_schema", spec)
        if isinstance(inner, dict) and isinstance(inner.get("schema"), dict):
            check_schema(inner["schema"], param)


def check_lark(text: str, param: str) -> None:
    """At most MAX_GRAMMAR_RULES rules (each `name:` definition, rules and terminals alike)."""
    rules = len(_LARK_RULE.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise LimitError(f"{param}: a grammar has at most {MAX_GRAMMAR_RULES} rules, got {rules}", param)


def check_schema(schema: dict, param: str) -> None:
    """The schema's text at most MAX_CONSTRAINT_BYTES, its nesting and $ref chains at most
    MAX_SCHEMA_DEPTH deep."""
    try:
        size = len(json.dumps(schema, separators=(",", ":")))
    except (ValueError, RecursionError):  # nested deeper than Python's own recursion allows
        raise LimitError(f"{param}: a JSON schema is nested at most {MAX_SCHEMA_DEPTH} deep", param) from None
    _check_size(size, "a JSON schema", param)
    _Depth(schema, param).walk(schema, 0)


def _check_size(size: int, what: str, param: str) -> None:
    if size > MAX_CONSTRAINT_BYTES:
        raise LimitError(f"{param}: {what} has at most {MAX_CONSTRAINT_BYTES} bytes, got {size}", param)


class _Depth:
    """The deepest path through a schema document, following local `$ref`s ("#/..." pointers) as
    edges: nesting and reference chains both cost native stack in the compiler. A reference back to
    a schema already on the path (recursion) ends the path; each schema is measured once."""

    def __init__(self, root: dict, param: str) -> None:
        self.root, self.param = root, param
        self.done: dict[int, int] = {}  # id(node) -> depth below it
        self.path: set[int] = set()

    def walk(self, node, depth: int) -> int:
        if depth > MAX_SCHEMA_DEPTH:
            raise LimitError(f"{self.param}: a JSON schema is nested (or chains $ref) at most {MAX_SCHEMA_DEPTH} "
                             f"deep", self.param)
        if not isinstance(node, (dict, list)) or id(node) in self.path:
            return 0
        if id(node) in self.done:
            if depth + self.done[id(node)] > MAX_SCHEMA_DEPTH:
                self.walk(None, depth + self.done[id(node)])
            return self.done[id(node)]
        self.path.add(id(node))
        children = list(node.values()) if isinstance(node, dict) else list(node)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            children.append(self._resolve(node["$ref"]))
        below = max((self.walk(child, depth + 1) + 1 for child in children), default=0)
        self.path.discard(id(node))
        self.done[id(node)] = below
        return below

    def _resolve(self, ref: str):
        """The schema a local JSON pointer names (None: not local, or not found)."""
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node
