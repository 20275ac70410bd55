"""Tool-call families: how a chat template shows tools to its model, and the syntax that model was trained
to call them in. One small table drives the three places that depend on it: rendering (a family's
template gets the request's `tools` itself), the constraint (a grammar that leaves text free until the
family's marker, then holds every call to its tool's JSON schema), and the reader (`CallsReader`: the
output -> content and `tool_calls`, whole or as stream deltas).

A call is written `open + call (sep call)* + close`, each call one JSON object {"name": N, KEY: {...}}
with the separators the templates' `tojson` writes (", " and ": "), so the forced tokens are the ones the
model saw in training:

    hermes       <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>     Qwen 2.5 / 3, Hermes 2 / 3, SmolLM3
    mistral      [TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]            Mistral 7B v0.3, Nemo, Small (v3 layout)
    granite      <|tool_call|>[{"name": N, "arguments": {...}}, ...]           Granite 3.x
    llama3_json  {"name": N, "parameters": {...}}  (the whole answer)         Llama 3.1 / 3.2 / 3.3
    qwen3_coder  <tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>
                 (XML calls, xml_calls.py)                                  Qwen3-Coder

The family is read from the layout a template gives an assistant's call, not from a substring: the
template renders a probe conversation (one call of a probe tool) and the family whose written call
appears in it is the template's. A template that uses `tools` but lays calls out in no family's way,
one that cannot render the probe, and one without tools (SmolLM2's) get the generic format of tools.py
(a system prompt listing the tools, calls after `<tool_call>`), and `tool_format` says why.

A marker that is a special token of the target's vocabulary (a real Mistral's `[TOOL_CALLS]`, Granite's
`<|tool_call|>`) enters the grammar as that token (`<[id]>`: the model's own token, never its spelling in
ordinary tokens), and the output keeps its text (`ToolPlan.shown`: the detokeniser would skip it), so the
reader finds the calls where the model put them. A marker that is text stays text.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
from dataclasses import dataclass

from ..speculative.grammar import TOOL_JSON_OPTIONS
from .call_syntax import CallReading, ValueEnd, held_back, lark_literal, rebase, regex_literal
from .xml_calls import XmlFamily

PROBE_NAME, PROBE_ARGUMENTS = "probe_fn", {"probe_key": "probe_value"}
PROBE_ID = "abcDEF123"  # nine letters and digits: what the strictest template (Mistral's) accepts

SEPARATORS = {**TOOL_JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}  # as json.dumps writes


@dataclass(frozen=True)
class Family:
    """One way of calling tools: how a template is recognised and how its model writes calls."""

    name: str
    marker: str  # the text that starts the calls ("" = the answer itself is the call)
    open: str  # the text from the marker to the first call's "{"
    sep: str  # between two calls
    close: str  # after the last call
    key: str = "arguments"  # the key of a call's arguments
    parallel: bool = True  # more than one call per answer
    id_chars: int = 0  # call ids the template demands: N letters and digits (0: "call_" + 24 hex)
    models: str = ""

    def call_id(self) -> str:
        """A new tool call id in the form this family's templates accept."""
        if self.id_chars:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.id_chars))
        return f"call_{secrets.token_hex(12)}"

    def written(self, name: str, arguments: dict) -> str:
        """How a template of this family writes the start of a call (to its closing brace, exclusive:
        some templates add an id after the arguments)."""
        return f'{self.open}{{"name": {json.dumps(name)}, "{self.key}": {json.dumps(arguments)}'

    def grammar(self, schemas: dict[str, dict], mode: str, parallel: bool = True,
                tokens: dict[str, int] | None = None) -> str:
        """A Lark grammar (llguidance) for an answer under `mode` ("auto", "required" or "named": then
        `schemas` holds the one tool): under auto, text is free until the marker (llama3_json: unless the
        answer starts with "{"), from there the calls hold their tools' schemas; otherwise the answer
        starts with the calls. `parallel` False (the request's `parallel_tool_calls`): one call at most.
        `tokens`: the family's markup that is one special token of the vocabulary (`special_tokens`),
        which the grammar takes as that token."""
        tokens = tokens or {}
        obj = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, self.key: rebase(
                   schema, f"#/anyOf/{i}/properties/{self.key}")},
                          "required": ["name", self.key], "additionalProperties": False}
                         for i, (name, schema) in enumerate(schemas.items())], "x-guidance": SEPARATORS}
        more = f" ({lark_literal(self.sep, tokens)} obj)*" if self.parallel and parallel and mode != "named" else ""
        rules = [f"calls: obj{more} {lark_literal(self.close, tokens)}" if self.close else f"calls: obj{more}",
                 f"obj: %json {json.dumps(obj)}"]
        if mode != "auto":
            return "\n".join([f"start: {lark_literal(self.open, tokens)} calls" if self.open else "start: calls", *rules]) + "\n"
        if not self.marker:  # the call is the whole answer: text is anything that does not start with "{"
            return "\n".join(["start: TEXT | calls", *rules, "TEXT: /[^{](.|\\n)*/"]) + "\n"
        m, rest = regex_literal(self.marker), self.open[len(self.marker):]
        text = f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{m}(.|\\n)*/"  # free text never spells the marker
        if self.marker in tokens:  # the text before the calls, then the marker's own token
            return "\n".join([f"start: TEXT | TEXT {lark_literal(self.open, tokens)} calls", *rules, text]) + "\n"
        lead = f"start: TEXT | LEAD {lark_literal(rest, tokens)} calls" if rest else "start: TEXT | LEAD calls"
        return "\n".join([lead, *rules, text, f"LEAD: /(.|\\n)*{m}/ & ~/(.|\\n)*{m}(.|\\n)+/"]) + "\n"

    def reader(self, mode: str, schemas: dict[str, dict]) -> "CallsReader":
        """A reader of an answer in this family's syntax, as it streams."""
        return CallsReader(self, mode)

    def markup(self) -> str:
        """The family's own text around calls (where a vocabulary's special tokens may stand)."""
        return self.open + self.sep + self.close


FAMILIES: tuple[Family | XmlFamily, ...] = (
    Family("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n",
           "\n</tool_call>", models="Qwen 2.5 / 3, Hermes 2 / 3, SmolLM3"),
    Family("mistral", "[TOOL_CALLS]", "[TOOL_CALLS] [", ", ", "]", id_chars=9,
           models="Mistral 7B Instruct v0.3, Mistral Nemo, Mistral Small (v3 layout)"),
    Family("granite", "<|tool_call|>", "<|tool_call|>[", ", ", "]", models="Granite 3.x"),
    XmlFamily("qwen3_coder", models="Qwen3-Coder (XML calls)"),
    Family("llama3_json", "", "", "", "", key="parameters", parallel=False,
           models="Llama 3.1 / 3.2 / 3.3 (JSON calls)"),
)


def family_of(template: str | None) -> Family | XmlFamily | None:
    """The family whose call layout a chat template uses, or None (the generic format)."""
    return _detect(template)[0]


def tool_format(template: str | None) -> str:
    """What a model with this chat template gets for tools: a family's name, or "generic" and why."""
    family, why = _detect(template)
    return family.name if family else f"generic ({why})" if why else "generic"


@functools.lru_cache(maxsize=16)
def _detect(template: str | None) -> tuple[Family | XmlFamily | None, str]:
    """(the family, "") or (None, why not): the template renders a probe call, and the family whose
    written call appears in the rendering is the template's."""
    if not template or "tools" not in template:
        return None, ""
    from ..models.light_tokenizer import render_template

    tool = {"type": "function", "function": {"name": PROBE_NAME, "description": "A probe.",
                                             "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"}}}}}
    call = {"id": PROBE_ID, "type": "function", "function": {"name": PROBE_NAME, "arguments": PROBE_ARGUMENTS}}
    messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": PROBE_ID, "name": PROBE_NAME, "content": "probed"}]
    try:
        text = render_template(template, messages, tools=[tool])
    except Exception as e:  # a template may refuse any conversation it was not written for
        return None, f"the chat template cannot render a tool call: {type(e).__name__}"
    family = next((f for f in FAMILIES if f.written(PROBE_NAME, PROBE_ARGUMENTS) in text), None)
    return (family, "") if family else (None, "the chat template's call layout is not a known family's")


def special_tokens(family: Family | XmlFamily, tokenizer) -> dict[str, int]:
    """The family's markup that the vocabulary makes one special token each (a real Mistral's
    `[TOOL_CALLS]`, Qwen's `<tool_call>` / `</tool_call>`): text -> id. The rest of it is text."""
    from ..chat_prompt import special_texts

    out = {}
    for text in special_texts(tokenizer):
        if text in family.markup() and len(ids := tokenizer.encode(text, add_special_tokens=False)) == 1:
            out[text] = ids[0]
    return out


_STRING = r'"(?:[^"\\]|\\.)*"'


class CallsReader(CallReading):
    """Reads a family's answer as it grows (`feed` the released text) into stream deltas: ("content", text)
    before the marker (text that might be the marker's start is held back), ("call", name) when a call's
    name is complete, ("arguments", fragment) for the next characters of its arguments value (the
    model's own text of it). `flush` hands back held text that never became a call."""

    def __init__(self, family: Family, mode: str) -> None:
        self.family, self.text = family, ""
        self.head = re.compile(r'\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"' + family.key + r'"\s*:\s*(?=\S)')
        self.calls: list[dict] = []  # {"name", "start", "end"}: where each call's arguments value lies
        self.begin: int | None = None if mode == "auto" else 0  # where the calls begin (after the content)
        self.sent = 0  # characters handed out (content, or the current call's arguments)
        self._value: ValueEnd | None = None
        self.free = False  # auto answered in text

    def arguments(self, i: int) -> str:
        call = self.calls[i]
        return self.text[call["start"]:call["end"] if call["end"] is not None else len(self.text)]

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.text += piece
        out: list[tuple[str, str]] = []
        if self.begin is None:
            if not self.free:
                self._find_begin()
            hold = self.begin
            if hold is None:
                hold = len(self.text) - (0 if self.free else held_back(self.text, self.family.marker or "{"))
            if hold > self.sent:
                out.append(("content", self.text[self.sent:hold]))
                self.sent = hold
            if self.begin is None:
                return out
        while True:
            if not self.calls or self.calls[-1]["end"] is not None:
                from_ = self.begin if not self.calls else self.calls[-1]["end"]
                m = self.head.search(self.text, from_)
                if m is None:
                    return out
                self.calls.append({"name": json.loads(m.group(1)), "start": m.end(), "end": None})
                self.sent, self._value = m.end(), ValueEnd()
                out.append(("call", self.calls[-1]["name"]))
            call = self.calls[-1]
            end = self._value.feed(self.text, max(self.sent, call["start"]))
            stop = len(self.text) if end < 0 else end
            if stop > self.sent:
                out.append(("arguments", self.text[self.sent:stop]))
                self.sent = stop
            if end < 0:
                return out
            call["end"] = end

    def _find_begin(self) -> None:
        marker = self.family.marker
        if not marker:  # the answer is a call when it starts with "{"
            stripped = self.text.lstrip()
            if stripped:
                self.begin, self.free = (len(self.text) - len(stripped), False) if stripped[0] == "{" else (None, True)
            return
        at = self.text.find(marker)
        if at >= 0:
            self.begin = at

    def complete(self) -> bool:
        """Whole calls: every arguments value is valid JSON and the answer ends with the family's close."""
        if not self.calls or any(c["end"] is None for c in self.calls):
            return False
        try:
            [json.loads(self.arguments(i)) for i in range(len(self.calls))]
        except ValueError:
            return False
        tail = self.text[self.calls[-1]["end"]:].strip()
        return tail.startswith("}") and tail[1:].strip() == self.family.close.strip()

    def tool_calls(self) -> list[dict]:
        return [{"id": self.family.call_id(), "type": "function",
                 "function": {"name": c["name"], "arguments": self.arguments(i)}} for i, c in enumerate(self.calls)]
