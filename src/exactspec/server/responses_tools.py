"""The Responses API's tool types -> the chat request's function tools, and a call's name back.

    function    as it is ({"type": "function", "name", "description", "parameters"})
    namespace   a group of function (or custom) tools: each becomes a function named NS__NAME
                (`flat_name`); a call to it goes back out as `name` NAME with `namespace` NS, the
                pair the client resolves (and reads in a later turn's `function_call` items)
    custom      a free-form tool: a function of one string parameter `input` that carries the tool's
                `format` (tools.CUSTOM): the generic format writes its call raw, under its Lark
                grammar or regex (tools.py); a call goes back out as a `custom_tool_call` item with
                that string as its raw `input`
    anything else (hosted tools: web_search, file_search, image_generation, code_interpreter,
                computer_use_preview, mcp, local_shell, ...; and types this server does not know):
                left out of the prompt and named in `Tools.skipped`, never a refusal -- this server
                runs no hosted tool, and an agent that sends one must still be served
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .api_error import ApiError
from .tools import CUSTOM, CUSTOM_INPUT

SEPARATOR = "__"  # NS__NAME, the MCP-style flat name (letters, digits, _ and -: a valid function name)


@dataclass
class Tools:
    """A request's tools as chat function tools, with what a call's name stands for."""

    chat: list[dict] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name -> (namespace, name)
    custom: set[str] = field(default_factory=set)  # flat names of custom tools
    skipped: list[str] = field(default_factory=list)  # tool types left out, as "type" or "type name"

    def output_item(self, call_id: str, flat: str, arguments: str, item_id: str, status: str) -> dict:
        """A call's output item, as the client's own tool list named it."""
        namespace, name = self.namespaced.get(flat, (None, flat))
        if flat in self.custom:
            item = {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name,
                    "input": custom_input(arguments), "status": status}
        else:
            item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
                    "arguments": arguments, "status": status}
        if namespace is not None:
            item["namespace"] = namespace
        return item


def flat_name(namespace: str | None, name: str) -> str:
    return name if not namespace else f"{namespace}{SEPARATOR}{name}"


def custom_input(arguments: str) -> str:
    """A custom tool's raw input from its call's arguments ({"input": "..."}); "" where they do not parse."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return ""
    return value.get(CUSTOM_INPUT, "") if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str) else ""


def read_tools(tools) -> Tools:
    """`tools` of a Responses body -> Tools (ApiError on a malformed function or group)."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", "tools")
    out = Tools()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ApiError(400, f"{where} must be an object", where)
        kind = tool.get("type")
        if kind == "namespace":
            namespace = tool.get("name")
            members = tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(members, list):
                raise ApiError(400, f'{where}: a namespace needs a "name" and a list of "tools"', where)
            for j, member in enumerate(members):
                _add(out, member, f"{where}.tools[{j}]", namespace)
        elif kind in ("function", "custom"):
            _add(out, tool, where, None)
        else:
            out.skipped.append(str(kind) if not isinstance(tool.get("name"), str) else f"{kind} {tool['name']}")
    return out


def _add(out: Tools, tool, where: str, namespace: str | None) -> None:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind not in ("function", "custom"):
        out.skipped.append(f"{kind} in {namespace}")
        return
    name = tool.get("name")
    if not isinstance(name, str):
        raise ApiError(400, f"{where}.name must be a string", f"{where}.name")
    flat = flat_name(namespace, name)
    if namespace:
        out.namespaced[flat] = (namespace, name)
    function = {"name": flat}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if kind == "custom":
        out.custom.add(flat)
        function["parameters"] = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                                  "required": [CUSTOM_INPUT], "additionalProperties": False}
        function[CUSTOM] = tool.get("format") if tool.get("format") is not None else {"type": "text"}
    elif tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    out.chat.append({"type": "function", "function": function})
