"""OpenAI function calling on top of grammar constraints: `tools` + `tool_choice` -> a constraint spec,
a system prompt that shows the model its tools, and the reading of the output as `message.tool_calls`.

    tool_choice "none" (or no tools)  -> plain text, tools not shown
    {"type": "function", "function": {"name": N}} -> output = N's arguments (JSON, its parameters schema)
    "required"                        -> output = {"name": one of the tools, "arguments": {...}}
    "auto" (the default with tools)   -> free text, or TAG followed by such a call

A call's `arguments` string is the model's own text of the arguments value (compact JSON, see
JSON_OPTIONS), read by `CallReader` as it is generated: the non-streamed answer and the streamed
argument deltas are the same characters.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..speculative.grammar import JSON_OPTIONS, grammar_from_spec
from ..errors import ExactSpecError
from .limits import MAX_TOOLS, check_schema

TAG = "<tool_call>"


@dataclass
class ToolPlan:
    mode: str  # "named", "required" or "auto"
    names: list[str]
    constraint: dict  # a constraint spec, as `grammar_from_spec` reads it
    system_prompt: str

    def read(self, text: str, done: bool) -> tuple[str | None, list[dict] | None]:
        """The generated text -> (message content, tool_calls); a call cut short (max_tokens) stays text."""
        reader = CallReader(self)
        reader.feed(text)
        if done and reader.complete():
            return None, [{"id": call_id(), "type": "function",
                           "function": {"name": reader.name, "arguments": reader.arguments}}]
        return text, None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# {"name":"N","arguments": -- the head of a call (required / auto); JSON_OPTIONS makes it compact
_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


class CallReader:
    """Reads a tool request's output as it grows (`feed` the released text) into what a stream sends:
    ("content", text) -- free text (auto without TAG), ("call", name) -- a call to `name` starts,
    ("arguments", fragment) -- the next characters of its arguments value. Named: the call starts at
    once and the whole output is the arguments. Required / auto: the call starts once its name is
    complete, and the arguments are the characters of the value after `"arguments":` (its closing brace
    ends them; the outer one is not theirs). Nothing is sent while it is undecided (a prefix of TAG, the
    head before the name is complete); `flush` hands such held text back as content."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text = plan, ""
        self.name = plan.names[0] if plan.mode == "named" else None
        self.body: int | None = None if plan.mode == "auto" else 0  # where the call's JSON starts in text
        self.start: int | None = 0 if plan.mode == "named" else None  # where the arguments value starts
        self.end: int | None = None  # where it ends (required / auto), once closed
        self.head = 0  # where the name ends (required / auto)
        self.sent = 0  # characters of text handed out
        self.free = False  # auto answered in text
        self.started = False  # ("call", name) was handed out
        self._value = _ValueEnd()

    @property
    def arguments(self) -> str:
        return "" if self.start is None else self.text[self.start:self.end]

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.text += piece
        out: list[tuple[str, str]] = []
        if self.body is None and not self.free:  # auto: a call begins with TAG, text begins otherwise
            if self.text.startswith(TAG):
                self.body = len(TAG)
            elif not TAG.startswith(self.text):
                self.free = True
        if self.free:
            piece, self.sent = self.text[self.sent:], len(self.text)
            return [("content", piece)] if piece else []
        if self.name is None and self.body is not None and (m := _NAME.match(self.text, self.body)):
            self.name, self.head = json.loads(m.group(1)), m.end()
        if self.name is not None and not self.started:
            self.started = True
            out.append(("call", self.name))
        if self.start is None and self.name is not None and (m := _ARGUMENTS.match(self.text, self.head)):
            self.start = self.sent = m.end()
        if self.start is not None:
            if self.plan.mode != "named" and self.end is None:
                end = self._value.feed(self.text, max(self.sent, self.start))
                self.end = end if end >= 0 else None
            stop = len(self.text) if self.end is None else self.end
            if stop > self.sent:
                out.append(("arguments", self.text[self.sent:stop]))
                self.sent = stop
        return out

    def flush(self) -> list[tuple[str, str]]:
        """At the end of the output: held text that never became a call, as content."""
        if self.started or self.sent >= len(self.text):
            return []
        held, self.sent = self.text[self.sent:], len(self.text)
        return [("content", held)]

    def complete(self) -> bool:
        """A whole call: its arguments (and, required / auto, the whole call object) are valid JSON."""
        if self.name is None or self.start is None:
            return False
        try:
            json.loads(self.arguments if self.plan.mode == "named" else self.text[self.body:])
            return self.plan.mode == "named" or self.end is not None
        except ValueError:
            return False


class _ValueEnd:
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


def plan_tools(tools: list | None, tool_choice) -> ToolPlan | None:
    """Check `tools` / `tool_choice` (ExactSpecError on a bad one) -> the plan, or None (no tools used).
    Every tool's parameters are checked (limits.py) and compiled, even under tool_choice "none"."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ExactSpecError("tool_choice needs tools")
        return None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    names = list(functions)
    listing = "\n".join(json.dumps({"name": n, "description": d, "parameters": p}) for n, (p, d) in functions.items())
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in functions:
            raise ExactSpecError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        schema = {**functions[name][0], "x-guidance": JSON_OPTIONS}
        prompt = f"Call the function {name}. Reply with its arguments as one JSON object.\n{listing}"
        return ToolPlan("named", [name], {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}, prompt)
    if choice not in ("auto", "required"):
        raise ExactSpecError(f"tool_choice must be none, auto, required or a named function, got {choice!r}")
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": n},
                                                         "arguments": rebase(functions[n][0], f"#/anyOf/{i}/properties/arguments")},
                        "required": ["name", "arguments"], "additionalProperties": False} for i, n in enumerate(names)],
             "x-guidance": JSON_OPTIONS}
    if choice == "required":
        prompt = f'Call one of these functions. Reply with {{"name": ..., "arguments": {{...}}}} only.\n{listing}'
        return ToolPlan("required", names, {"type": "json_schema", "json_schema": {"name": "call", "schema": calls}},
                        prompt)
    lark = f'start: TEXT | "{TAG}" call\ncall: %json {json.dumps(calls)}\nTEXT: /[^<](.|\\n)*/\n'
    prompt = (f'You may call one of these functions by replying {TAG}{{"name": ..., "arguments": {{...}}}}, '
              f"or answer in text.\n{listing}")
    return ToolPlan("auto", names, {"type": "grammar", "grammar": lark}, prompt)


def _functions(tools: list) -> dict[str, tuple[dict, str]]:
    """name -> (parameters schema, description) of each tool, checked: unique names, schemas within
    the limits that compile."""
    if len(tools) > MAX_TOOLS:
        raise ExactSpecError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ExactSpecError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        if fn["name"] in functions:
            raise ExactSpecError(f"tools[{i}]: the name {fn['name']!r} is used by two tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ExactSpecError(f"tools[{i}].function.parameters must be a JSON schema object")
        check_schema(params, f"tools[{i}].function.parameters")
        try:
            grammar_from_spec({"type": "json_schema", "json_schema": {"name": fn["name"], "schema": params}})
        except ExactSpecError as e:
            raise ExactSpecError(f"tools[{i}].function.parameters: {e}") from None
        functions[fn["name"]] = (params, fn.get("description", ""))
    return functions


def rebase(schema, base: str):
    """`schema` with its local references ("#", "#/$defs/X") rewritten to point below `base` (a JSON
    pointer to where the schema is embedded), so `$defs` keep working inside a larger schema."""
    if isinstance(schema, list):
        return [rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: rebase(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out
