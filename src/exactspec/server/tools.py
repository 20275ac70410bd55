"""OpenAI function calling on top of grammar constraints: `tools` + `tool_choice` -> a constraint spec,
a system prompt that shows the model its tools, and the reading of the output as `message.tool_calls`.

    tool_choice "none" (or no tools)  -> plain text, tools not shown
    {"type": "function", "function": {"name": N}} -> output = N's arguments (JSON, its parameters schema)
    "required"                        -> output = {"name": one of the tools, "arguments": {...}}
    "auto" (the default with tools)   -> free text, or TAG followed by such a call
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..constraints import JSON_OPTIONS
from ..errors import ExactSpecError

TAG = "<tool_call>"


@dataclass
class ToolPlan:
    mode: str  # "named", "required" or "auto"
    names: list[str]
    constraint: dict  # a constraints.grammar_from_spec spec
    system_prompt: str

    def read(self, text: str, done: bool) -> tuple[str | None, list[dict] | None]:
        """The generated text -> (message content, tool_calls); a call cut short (max_tokens) stays text."""
        if self.mode == "named":
            return (None, [_call(self.names[0], text)]) if done else (text, None)
        body = text[len(TAG):] if self.mode == "auto" and text.startswith(TAG) else text
        if self.mode == "auto" and not text.startswith(TAG):
            return text, None
        try:
            call = json.loads(body)
            return None, [_call(call["name"], json.dumps(call["arguments"]))]
        except (ValueError, KeyError, TypeError):
            return text, None


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def plan_tools(tools: list | None, tool_choice) -> ToolPlan | None:
    """Check `tools` / `tool_choice` (ExactSpecError on a bad one) -> the plan, or None (no tools used)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ExactSpecError("tool_choice needs tools")
        return None
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ExactSpecError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ExactSpecError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions[fn["name"]] = (params, fn.get("description", ""))
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
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": functions[n][0]},
                        "required": ["name", "arguments"], "additionalProperties": False} for n in names],
             "x-guidance": JSON_OPTIONS}
    if choice == "required":
        prompt = f'Call one of these functions. Reply with {{"name": ..., "arguments": {{...}}}} only.\n{listing}'
        return ToolPlan("required", names, {"type": "json_schema", "json_schema": {"name": "call", "schema": calls}},
                        prompt)
    lark = f'start: TEXT | "{TAG}" call\ncall: %json {json.dumps(calls)}\nTEXT: /[^<](.|\\n)*/\n'
    prompt = (f'You may call one of these functions by replying {TAG}{{"name": ..., "arguments": {{...}}}}, '
              f"or answer in text.\n{listing}")
    return ToolPlan("auto", names, {"type": "grammar", "grammar": lark}, prompt)
