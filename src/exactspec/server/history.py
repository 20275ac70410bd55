"""An agent's tool history for the chat template: assistant `tool_calls`, tool results' `tool_call_id`
and `name`, so the model sees which tool it called and what came back.

A template that knows tools (its source mentions `tool_calls`) gets the messages as Hugging Face
templates expect them: `tool_calls` items {"type": "function", "function": {"name", "arguments"}} with
the arguments parsed into a dict where they are JSON, and tool messages with `tool_call_id` / `name`.
A template without tool syntax (SmolLM2's ChatML) gets the documented text rendering instead, in the
format the server's own tool calls use (tools.TAG):

    assistant:  <content>\\n<tool_call>{"name": N, "arguments": {...}}</tool_call>   (one line per call)
                a free-form tool's call: <tool_call>N\\n<raw input></tool_call>
    tool:       <tool_response name="N" id="ID">\\n<content>\\n</tool_response>
"""

from __future__ import annotations

import json

from .tools import CUSTOM_CLOSE, CUSTOM_INPUT, TAG

END_TAG = CUSTOM_CLOSE


def name_tool_results(messages: list[dict]) -> list[dict]:
    """Tool messages named after the call they answer (an earlier assistant message's tool_calls), so
    the template shows which tool returned what; an answer to no known call stays unnamed."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and not message.get("name") and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]
    return messages


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tool calls itself."""
    return bool(template) and "tool_calls" in template


def for_template(messages: list[dict], template: str | None, custom: frozenset[str] = frozenset()) -> list[dict]:
    """`ChatCompletionRequest.chat()` messages -> the messages to render with `template`. A `developer`
    message is a system message where the template has no such role (OpenAI's newer name for it).
    `custom`: the free-form tools' names (tools.ToolPlan.custom): in the generic format their earlier
    calls are written as the model writes them, raw."""
    developer = bool(template) and "developer" in template
    return [_structured(m) if knows_tools(template) else _as_text(m, custom)
            for m in (m if developer or m["role"] != "developer" else {**m, "role": "system"}
                      for m in name_tool_results(messages))]


def fold_late_system(messages: list[dict]) -> list[dict]:
    """For a template that renders a system message only first: each later one (a mid-conversation
    system message) folded into the next user message's start, or, with none after it, the last one's end."""
    out: list[dict] = []
    pending: list[str] = []
    for i, message in enumerate(messages):
        if message["role"] == "system" and i > 0:
            pending.append(message["content"])
        elif message["role"] == "user" and pending:
            out.append({**message, "content": "\n\n".join(pending + [message["content"]])})
            pending = []
        else:
            out.append(message)
    if pending:
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        if not users:
            return messages
        out[users[-1]] = {**out[users[-1]], "content": "\n\n".join([out[users[-1]]["content"]] + pending)}
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_text(name: str, arguments: str, custom: frozenset[str]) -> str:
    """An earlier call in the generic format: JSON, or a free-form tool's raw input (tools.py)."""
    value = _arguments(arguments) if name in custom else None
    raw = value.get(CUSTOM_INPUT) if isinstance(value, dict) else None
    if isinstance(raw, str):
        return f"{TAG}{name}\n{raw}{END_TAG}"
    return f'{TAG}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{END_TAG}'


def _structured(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [{"id": c["id"], "type": "function",
                                       "function": {"name": c["function"]["name"],
                                                    "arguments": _arguments(c["function"]["arguments"])}}
                                      for c in calls]}


def _as_text(message: dict, custom: frozenset[str] = frozenset()) -> dict:
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        lines = [_call_text(c["function"]["name"], c["function"]["arguments"], custom) for c in message["tool_calls"]]
        out["content"] = "\n".join(([message["content"]] if message["content"] else []) + lines)
    elif message["role"] == "tool":
        attrs = "".join(f' {key}={json.dumps(message[field])}' for key, field in (("name", "name"),
                                                                                 ("id", "tool_call_id"))
                        if message.get(field))
        out["content"] = f"<tool_response{attrs}>\n{message['content']}\n</tool_response>"
    elif message.get("name"):
        out["name"] = message["name"]
    return out
