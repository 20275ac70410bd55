"""OpenAI function calling on top of grammar constraints: `tools` + `tool_choice` -> a constraint spec,
how the model is shown its tools, and the reading of the output as `message.tool_calls`.

A model whose chat template belongs to a tool family (families.py: Hermes / Qwen, Mistral, Granite,
Llama 3.x) is shown the tools by its own template and answers in its own call syntax, read by
`families.CallsReader`. Every other model gets the generic format below: a system prompt listing the
tools, and calls read by `CallReader`:

    tool_choice "none" (or no tools)  -> plain text, tools not shown
    {"type": "function", "function": {"name": N}} -> output = N's arguments (JSON, its parameters schema)
    "required"                        -> output = {"name": one of the tools, "arguments": {...}}
    "auto" (the default with tools)   -> free text, or TAG followed by such a call

A free-form tool (a Responses `custom` tool: one raw string in, no JSON) is written TAG NAME, a newline,
its raw input and CUSTOM_CLOSE, the input held to the tool's own grammar (`format`: Lark or regex, a
subgrammar the call's rule references; text: anything without CUSTOM_CLOSE); its call's arguments are
{"input": RAW}. Named, the whole output is the raw input.

A call's `arguments` string is the model's own text of the arguments value (compact JSON, see
TOOL_JSON_OPTIONS), read by `CallReader` as it is generated: the non-streamed answer and the streamed
argument deltas are the same characters.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..errors import ExactSpecError, FieldError
from ..speculative.grammar import TOOL_JSON_OPTIONS, grammar_from_spec
from .call_syntax import ValueEnd, lark_literal, rebase
from .families import CallsReader, Family
from .xml_calls import XmlFamily, XmlReader
from .limits import MAX_TOOLS, check_constraint, check_schema

TAG = "<tool_call>"
CUSTOM_CLOSE = "</tool_call>"  # ends a free-form call's raw input
CUSTOM_INPUT = "input"  # a free-form call's arguments: {"input": RAW}
CUSTOM = "x-exactspec-custom"  # a function's key holding a free-form tool's `format` (responses_tools.py)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name


@dataclass
class ToolPlan:
    """How a request's tools are shown and its answer read. `family` None: the generic format (the
    tools listed in `system_prompt`); a family (families.py): the chat template renders `tools` itself
    and the answer is read in the family's call syntax."""

    mode: str  # "named", "required" or "auto"
    names: list[str]
    constraint: dict  # a constraint spec, as `grammar_from_spec` reads it
    system_prompt: str = ""
    family: Family | XmlFamily | None = None
    tools: list[dict] | None = None  # what the chat template gets as `tools` (a family's)
    schemas: dict[str, dict] | None = None  # a family's tools: name -> parameters schema (its reader's)
    shown: dict[int, str] | None = None  # special tokens whose text the output keeps (a family's markup tokens)
    custom: frozenset[str] = frozenset()  # free-form tools (the generic format): raw input, read as {"input": RAW}
    approximated: list[str] | None = None  # tools whose schema's `oneOf` the grammar holds as `anyOf`

    def reader(self) -> "CallReader | CallsReader | XmlReader":
        """A reader of this plan's answer as it streams."""
        return CallReader(self) if self.family is None else self.family.reader(self.mode, self.schemas)

    def read(self, text: str, done: bool) -> tuple[str | None, list[dict] | None]:
        """The generated text -> (message content, tool_calls); a call cut short (max_tokens) stays text."""
        reader = self.reader()
        reader.feed(text)
        if not (done and reader.complete()):
            return text, None
        if self.family is not None:
            return reader.content(), reader.tool_calls()
        return None, [{"id": call_id(), "type": "function",
                       "function": {"name": reader.name, "arguments": reader.arguments}}]

    def call_id(self) -> str:
        """A new call id (the family's form: Mistral's templates take 9 letters and digits)."""
        return call_id() if self.family is None else self.family.call_id()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# {"name":"N","arguments": -- the head of a call (required / auto); TOOL_JSON_OPTIONS make it compact
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
        tagged = plan.mode == "auto" or (plan.custom and plan.mode == "required")
        self.body: int | None = None if tagged else 0  # where the call's JSON starts in text
        self.raw: int | None = 0 if plan.mode == "named" and self.name in plan.custom else None  # free-form input
        self.start: int | None = 0 if plan.mode == "named" else None  # where the arguments value starts
        self.end: int | None = None  # where it ends (required / auto), once closed
        self.head = 0  # where the name ends (required / auto)
        self.sent = 0  # characters of text handed out
        self.free = False  # auto answered in text
        self.started = False  # ("call", name) was handed out
        self._value = ValueEnd()

    @property
    def arguments(self) -> str:
        if self.raw is not None:  # a free-form call: its raw input, once whole
            end = len(self.text) - (len(CUSTOM_CLOSE) if self.plan.mode != "named" else 0)
            return json.dumps({CUSTOM_INPUT: self.text[self.raw:end]}, ensure_ascii=False) if self.complete() else ""
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
        if self.name is None and self.body is not None and self.plan.custom and self.text[self.body:self.body + 1] not in ("", "{"):
            line = self.text.find("\n", self.body)  # a free-form call: NAME, a newline, the raw input
            if line >= 0:
                self.name, self.raw = self.text[self.body:line], line + 1
        if self.name is None and self.body is not None and (m := _NAME.match(self.text, self.body)):
            self.name, self.head = json.loads(m.group(1)), m.end()
        if self.name is not None and not self.started:
            self.started = True
            out.append(("call", self.name))
        if self.raw is not None:  # its input goes out whole at the end (`flush`): the grammar says where it ends
            return out
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
        if self.raw is not None:
            return [("arguments", self.arguments)] if self.complete() else []
        if self.started or self.sent >= len(self.text):
            return []
        held, self.sent = self.text[self.sent:], len(self.text)
        return [("content", held)]

    def complete(self) -> bool:
        """A whole call: its arguments (and, required / auto, the whole call object) are valid JSON; a
        free-form call's input closed (named: the grammar held the whole output to its format)."""
        if self.raw is not None:
            return self.plan.mode == "named" or (self.text.endswith(CUSTOM_CLOSE)
                                                  and len(self.text) >= self.raw + len(CUSTOM_CLOSE))
        if self.name is None or self.start is None:
            return False
        try:
            json.loads(self.arguments if self.plan.mode == "named" else self.text[self.body:])
            return self.plan.mode == "named" or self.end is not None
        except ValueError:
            return False


def plan_tools(tools: list | None, tool_choice, family: Family | XmlFamily | None = None, parallel=True,
               tokens: dict[str, int] | None = None) -> ToolPlan | None:
    """Check `tools` / `tool_choice` (FieldError naming the field on a bad one) -> the plan, or None (no
    tools used). Every tool's parameters are checked (limits.py) and compiled, even under tool_choice "none".
    `family`: the chat template's tool family (families.family_of), None for the generic format;
    `parallel`: the request's `parallel_tool_calls` (False: one call per answer, where a family has more);
    `tokens`: the family's markup that is a special token of the vocabulary (families.special_tokens)."""
    if tools is not None and not isinstance(tools, list):
        raise FieldError("tools must be a list of tools", "tools")
    if not tools:
        if tool_choice is not None and tool_choice not in ("none", "auto"):
            raise FieldError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    functions = _functions(tools)
    choice = check_choice(tool_choice, list(functions))
    if choice == "none":
        return None
    plan = _plan(tools, functions, choice, family, parallel, tokens)
    plan.approximated = [n for n in plan.names if '"oneOf"' in json.dumps(functions[n][0])]
    return plan


def _plan(tools: list, functions: dict, choice: str, family: Family | XmlFamily | None, parallel: bool,
          tokens: dict[str, int] | None) -> ToolPlan:
    names = list(functions)
    if family is not None:
        schemas = {n: functions[n][0] for n in ([choice] if choice not in ("auto", "required") else names)}
        mode = choice if choice in ("auto", "required") else "named"
        grammar = family.grammar(schemas, mode, parallel, tokens)
        return ToolPlan(mode, list(schemas), {"type": "grammar", "grammar": grammar}, family=family, tools=tools,
                        schemas=schemas, shown={i: text for text, i in tokens.items()} if tokens else None)
    customs = _customs(tools)
    listing = "\n".join(_listed(n, p, d, customs.get(n)) for n, (p, d) in functions.items())
    if customs and (choice in customs or choice in ("auto", "required")):
        return _free_form_plan(choice, names, functions, customs, listing)
    if choice not in ("auto", "required"):
        name = choice
        schema = {**functions[name][0], "x-guidance": TOOL_JSON_OPTIONS}
        prompt = f"Call the function {name}. Reply with its arguments as one JSON object.\n{listing}"
        return ToolPlan("named", [name], {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}, prompt)
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": n},
                                                         "arguments": rebase(functions[n][0], f"#/anyOf/{i}/properties/arguments")},
                        "required": ["name", "arguments"], "additionalProperties": False} for i, n in enumerate(names)],
             "x-guidance": TOOL_JSON_OPTIONS}
    if choice == "required":
        prompt = f'Call one of these functions. Reply with {{"name": ..., "arguments": {{...}}}} only.\n{listing}'
        return ToolPlan("required", names, {"type": "json_schema", "json_schema": {"name": "call", "schema": calls}},
                        prompt)
    lark = f'start: TEXT | "{TAG}" call\ncall: %json {json.dumps(calls)}\nTEXT: /[^<](.|\\n)*/\n'
    prompt = (f'You may call one of these functions by replying {TAG}{{"name": ..., "arguments": {{...}}}}, '
              f"or answer in text.\n{listing}")
    return ToolPlan("auto", names, {"type": "grammar", "grammar": lark}, prompt)


def _listed(name: str, parameters: dict, description: str, form: dict | None = None) -> str:
    """One tool's line of the generic format's listing: compact JSON, without what only a validator reads
    (`$schema`, `$id`): the model reads the tool, the grammar holds it to its schema. A free-form tool
    shows its `format` (its grammar's text) in place of parameters."""
    if form is not None:
        return json.dumps({"name": name, "description": description, "format": form}, ensure_ascii=False,
                          separators=(",", ":"))
    shown = {k: v for k, v in parameters.items() if k not in ("$schema", "$id")}
    return json.dumps({"name": name, "description": description, "parameters": shown}, ensure_ascii=False,
                      separators=(",", ":"))


def _free_form_plan(choice: str, names: list[str], functions: dict, customs: dict[str, dict],
                    listing: str) -> ToolPlan:
    """The generic format's plan where free-form tools are offered: TAG, then a JSON call to a function
    or NAME + newline + raw input + CUSTOM_CLOSE for a free-form tool, each input under its format."""
    custom = frozenset(customs)
    if choice in customs:  # named: the output is the raw input
        prompt = f"Call the tool {choice}. Reply with its raw input only, as its format says.\n{listing}"
        return ToolPlan("named", [choice], _format_spec(customs[choice]), prompt, custom=custom)
    rules, body, subgrammars = [], [], {}
    plain = [n for n in names if n not in customs]
    if plain:
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": rebase(
                     functions[n][0], f"#/anyOf/{i}/properties/arguments")}, "required": ["name", "arguments"],
                            "additionalProperties": False} for i, n in enumerate(plain)], "x-guidance": TOOL_JSON_OPTIONS}
        body.append("call")
        rules.append(f"call: %json {json.dumps(calls)}")
    for i, (name, form) in enumerate(customs.items()):
        body.append(f"c{i}")
        spec = _format_spec(form)
        if spec["type"] == "text":
            rules += [f"c{i}: {lark_literal(name + chr(10))} R{i}",
                      f"R{i}: /(.|\\n)*<\\/tool_call>/ & ~/(.|\\n)*<\\/tool_call>(.|\\n)+/"]
        else:
            subgrammars[f"g{i}"] = spec
            rules.append(f"c{i}: {lark_literal(name + chr(10))} @g{i} {lark_literal(CUSTOM_CLOSE)}")
    start = f'start: "{TAG}" body' if choice == "required" else f'start: TEXT | "{TAG}" body\nTEXT: /[^<](.|\\n)*/'
    lark = "\n".join([start, f"body: {' | '.join(body)}", *rules]) + "\n"
    prompt = (f'{"Call" if choice == "required" else "You may call"} one of these tools: a function by replying '
              f'{TAG}{{"name": ..., "arguments": {{...}}}}, a tool with a "format" by replying {TAG} then its name, '
              f"a newline, its raw input as the format says, and {CUSTOM_CLOSE}"
              f'{"" if choice == "required" else "; or answer in text"}.\n{listing}')
    return ToolPlan(choice, names, {"type": "grammar", "grammar": lark, "subgrammars": subgrammars}, prompt,
                    custom=custom)


def _format_spec(form: dict) -> dict:
    """A free-form tool's `format` -> a constraint spec: its Lark grammar or regex, or text."""
    if form.get("type") != "grammar":
        return {"type": "text"}
    if form.get("syntax") == "regex":
        return {"type": "regex", "regex": form["definition"]}
    return {"type": "grammar", "grammar": form["definition"]}


def _customs(tools: list) -> dict[str, dict]:
    """name -> `format` of each free-form tool (a function carrying CUSTOM; checked by `_functions`)."""
    return {t["function"]["name"]: t["function"][CUSTOM] for t in tools
            if isinstance(t.get("function"), dict) and CUSTOM in t["function"]}


def check_format(form, where: str) -> None:
    """A free-form tool's `format`: {"type": "text"} or {"type": "grammar", "syntax": "lark" | "regex",
    "definition": ...}, its grammar compiled (a FieldError names the field)."""
    if not isinstance(form, dict) or form.get("type") not in ("text", "grammar"):
        raise FieldError(f'{where}.format must be {{"type": "text"}} or {{"type": "grammar", "syntax", "definition"}}',
                         f"{where}.format")
    if form["type"] == "text":
        return
    if form.get("syntax") not in ("lark", "regex") or not isinstance(form.get("definition"), str):
        raise FieldError(f'{where}.format needs "syntax" (lark or regex) and a "definition" string', f"{where}.format")
    spec = _format_spec(form)
    try:
        check_constraint(spec, f"{where}.format.definition")
        grammar_from_spec(spec)
    except ExactSpecError as e:
        raise FieldError(f"{where}.format.definition: {e}", f"{where}.format.definition") from None


def check_choice(tool_choice, names: list[str]) -> str:
    """`tool_choice` checked against the tools' `names` -> "none", "auto", "required" or the named tool's
    name; a FieldError names the part that is wrong (`tool_choice.function.name`, ...)."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise FieldError(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}",
                             "tool_choice")
        return tool_choice
    if not isinstance(tool_choice, dict):
        raise FieldError("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                         "tool_choice")
    if tool_choice.get("type") != "function":
        raise FieldError(f"tool_choice.type must be \"function\", got {tool_choice.get('type')!r}", "tool_choice.type")
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise FieldError(f"tool_choice.function must be an object {{\"name\": ...}}, got {_shown(function)}",
                         "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str):
        raise FieldError(f"tool_choice.function.name must be a string, got {_shown(name)}", "tool_choice.function.name")
    if name not in names:
        raise FieldError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                         "tool_choice.function.name")
    return name


def _shown(value) -> str:
    """A short rendering of a bad value for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _functions(tools: list) -> dict[str, tuple[dict, str]]:
    """name -> (parameters schema, description) of each tool, checked: the OpenAI shape, unique names,
    schemas within the limits that compile. A FieldError names the tool and field (`tools[2].function.name`)."""
    if len(tools) > MAX_TOOLS:
        raise FieldError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise FieldError(f'{where} must be {{"type": "function", "function": {{"name", ...}}}}', where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise FieldError(f'{where}.function must be an object {{"name", "description", "parameters"}}',
                             f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise FieldError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {_shown(name)}",
                             f"{where}.function.name")
        if name in functions:
            raise FieldError(f"{where}: the name {name!r} is used by two tools", f"{where}.function.name")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise FieldError(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise FieldError(f"{where}.function.parameters must be a JSON schema object",
                             f"{where}.function.parameters")
        check_schema(params, f"{where}.function.parameters")
        if CUSTOM in fn:
            check_format(fn[CUSTOM], where)
        try:
            grammar_from_spec({"type": "json_schema", "json_schema": {"name": name, "schema": {
                **params, "x-guidance": TOOL_JSON_OPTIONS}}})
        except ExactSpecError as e:
            raise FieldError(f"{where}.function.parameters: {e}", f"{where}.function.parameters") from None
        functions[name] = (params, description)
    return functions
