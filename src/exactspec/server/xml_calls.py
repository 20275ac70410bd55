"""The XML call layout of Qwen3-Coder's templates: a tool family whose calls are not JSON objects.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A string VALUE is the text itself; any other is JSON (the template writes mappings and lists with
`tojson`, numbers as they print). The grammar holds each call to its tool: the tool's parameters in the
order of its schema's `properties`, the required ones present, a string's `enum` as its alternatives and
its `minLength` / `maxLength` as its length, every other value by its schema (`%json`). The reader turns a call into the JSON arguments a client
expects, each value by its schema's type; a call's arguments go out whole once its `</function>` is in
(the one that follows its last value: a value may hold any other text, markup included).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from ..speculative.grammar import LENIENT_SCHEMA
from .call_syntax import CallReading, held_back, lark_literal, regex_literal

_FUNCTION = re.compile(r"<function=([^>\n]+)>\n")
_OPEN, _CLOSE, _END = "<parameter=", "\n</parameter>\n", "</function>"


@dataclass(frozen=True)
class XmlFamily:
    """A tool family (families.Family's interface) whose calls are XML blocks."""

    name: str
    marker: str = "<tool_call>"
    models: str = ""

    @property
    def open(self) -> str:
        return self.marker + "\n"

    def markup(self) -> str:
        return "<tool_call>\n</function>\n</tool_call>"

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def written(self, name: str, arguments: dict) -> str:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in arguments.items())
        return f"{self.open}<function={name}>\n{params}</function>"

    def reader(self, mode: str, schemas: dict[str, dict]) -> "XmlReader":
        return XmlReader(self, mode, schemas)

    def grammar(self, schemas: dict[str, dict], mode: str, parallel: bool = True,
                tokens: dict[str, int] | None = None) -> str:
        """A Lark grammar for an answer under `mode` (see families.Family.grammar). A string value's
        terminal takes its closing line with it (the lexer never has to guess where the text ends)."""
        tokens = tokens or {}
        rules, calls = [], []
        close = "\n</parameter>\n"
        for i, (name, schema) in enumerate(schemas.items()):
            params = []
            required = set(schema.get("required", []))
            for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
                if _is_text(prop):  # a regex is a terminal (UPPERCASE)
                    value = f"V{i}_{j}"
                    rules.append(f"{value}: {_text(prop)}")
                else:
                    value = f"v{i}_{j} {lark_literal(close)}"
                    rules.append(f"v{i}_{j}: %json {json.dumps({**prop, 'x-guidance': LENIENT_SCHEMA})}")
                part = f"{lark_literal(f'<parameter={key}>' + chr(10))} {value}"
                params.append(f"({part})" if key in required else f"({part})?")
            calls.append(f"f{i}")
            rules.append(f"f{i}: {lark_literal(f'<function={name}>' + chr(10))} {' '.join(params)} "
                         f"{lark_literal('</function>' + chr(10) + '</tool_call>', tokens)}")
        functions = f"({' | '.join(calls)})"
        more = f" ({lark_literal(chr(10) + self.open, tokens)} {functions})*" if parallel and mode != "named" else ""
        rules.insert(0, f"calls: {functions}{more}")
        if mode != "auto":
            return "\n".join([f"start: {lark_literal(self.open, tokens)} calls", *rules]) + "\n"
        m = regex_literal(self.marker)
        text = f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{m}(.|\\n)*/"
        if self.marker in tokens:  # the text before the calls, then the marker's own token
            return "\n".join([f"start: TEXT | TEXT {lark_literal(self.open, tokens)} calls", *rules, text]) + "\n"
        lead = f"LEAD: /(.|\\n)*{m}\\n/ & ~/(.|\\n)*{m}\\n(.|\\n)+/"  # the text, the marker and its newline
        return "\n".join(["start: TEXT | LEAD calls", *rules, text, lead]) + "\n"


def _parameters(text: str, at: int, keys) -> tuple[list[tuple[str, str]], int] | None:
    """A call's parameters from `at` (just past its `<function=NAME>` line), read as the grammar writes
    them: each opens with one of the tool's `keys` and its value runs to the first closing line after it
    (a string's terminal cannot hold one; a JSON value holds no raw newline), so a `</function>` or a
    `<function=X>` inside a value is text of that value -> ((key, raw value) pairs, the index past
    `</function>`); None while the call is still being written."""
    params = []
    while not text.startswith(_END, at):
        key = next((k for k in keys if text.startswith(f"{_OPEN}{k}>\n", at)), None)
        value = at + len(f"{_OPEN}{key}>\n")
        close = text.find(_CLOSE, value) if key is not None else -1
        if close < 0:
            return None
        params.append((key, text[value:close]))
        at = close + len(_CLOSE)
    return params, at + len(_END)


def _is_text(prop: dict) -> bool:
    """Whether a parameter's value is written as its text (a string), not as JSON."""
    return prop.get("type") == "string" or ("enum" in prop and all(isinstance(v, str) for v in prop["enum"]))


def _text(prop: dict) -> str:
    """The terminal of a string value and its closing line: the enum's texts, or any text (of the
    schema's length) that does not hold the closing line itself."""
    if "enum" in prop:
        return "/" + "|".join(f"({regex_literal(v)})" for v in prop["enum"]) + "\\n<\\/parameter>\\n/"
    low, high = int(prop.get("minLength", 0)), prop.get("maxLength")
    count = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}" if low else "*"
    return (f"/(.|\\n){count}\\n<\\/parameter>\\n/ & "
            f"~/(.|\\n)*\\n<\\/parameter>(.|\\n)(.|\\n)+/")


class XmlReader(CallReading):
    """Reads an XML-layout answer as it grows (families.CallsReader's interface): ("content", text)
    before the calls, ("call", name) once a function's name is in, ("arguments", json) once it closes."""

    def __init__(self, family: XmlFamily, mode: str, schemas: dict[str, dict]) -> None:
        self.family, self.schemas, self.text = family, schemas, ""
        self.begin: int | None = None if mode == "auto" else 0
        self.calls: list[dict] = []  # {"name", "arguments" (JSON text, None while open), "at"}
        self.sent = 0
        self.at = 0  # where reading goes on

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.text += piece
        out: list[tuple[str, str]] = []
        if self.begin is None:
            at = self.text.find(self.family.marker)
            self.begin = at if at >= 0 else None
            hold = self.begin if self.begin is not None else len(self.text) - held_back(self.text, self.family.marker)
            if hold > self.sent:
                out.append(("content", self.text[self.sent:hold]))
                self.sent = hold
            if self.begin is None:
                return out
            self.at = self.begin
        while True:
            if not self.calls or self.calls[-1]["arguments"] is not None:
                m = _FUNCTION.search(self.text, self.at)
                if m is None:
                    return out
                self.calls.append({"name": m.group(1), "arguments": None})
                self.at = m.end()
                out.append(("call", m.group(1)))
            call = self.calls[-1]
            block = _parameters(self.text, self.at, (self.schemas.get(call["name"]) or {}).get("properties") or {})
            if block is None:
                return out
            params, self.at = block
            call["arguments"] = self._arguments(call["name"], params)
            out.append(("arguments", call["arguments"]))

    def _arguments(self, name: str, params: list[tuple[str, str]]) -> str:
        props = (self.schemas.get(name) or {}).get("properties") or {}
        values = {}
        for key, raw in params:
            if _is_text(props.get(key) or {}):
                values[key] = raw
            else:
                try:
                    values[key] = json.loads(raw)
                except ValueError:
                    values[key] = raw
        return json.dumps(values, ensure_ascii=False)

    def complete(self) -> bool:
        if not self.calls or any(c["arguments"] is None for c in self.calls):
            return False
        return self.text[self.at:].strip() == "</tool_call>"

    def tool_calls(self) -> list[dict]:
        return [{"id": self.family.call_id(), "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
