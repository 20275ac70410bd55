"""An agent's tool history for the chat template: assistant `tool_calls`, tool results' `tool_call_id`
and `name`, so the model sees which tool it called and what came back.

A template that knows tools (its source mentions `tool_calls`) gets the messages as Hugging Face
templates expect them: `tool_calls` items {"type": "function", "function": {"name", "arguments"}} with
the arguments parsed into a dict where they are JSON, and tool messages with `tool_call_id` / `name`.
A template without tool syntax (SmolLM2's ChatML) gets the documented text rendering instead, in the
format the server's own tool calls use (tools.TAG):

    assistant:  <content>\\n<tool_call>{"name": N, "arguments": {...}}</tool_call>   (one line per call)
    tool:       <tool_response name="N" id="ID">\\n<content>\\n</tool_response>
"""

from __future__ import annotations

import json

from .tools import TAG

END_TAG = "</tool_call>"


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


def for_template(messages: list[dict], template: str | None) -> list[dict]:
    """`ChatCompletionRequest.chat()` messages -> the messages to render with `template`. A `developer`
    message is a system message where the template has no such role (OpenAI's newer name for it)."""
    render = _structured if knows_tools(template) else _as_text
    developer = bool(template) and "developer" in template
    return [render(m if developer or m["role"] != "developer" else {**m, "role": "system"})
            for m in name_tool_results(messages)]


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


def _structured(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [{"id": c["id"], "type": "function",
                                       "function": {"name": c["function"]["name"],
                                                    "arguments": _arguments(c["function"]["arguments"])}}
                                      for c in calls]}


def _as_text(message: dict) -> dict:
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        lines = [f'{TAG}{{"name": {json.dumps(c["function"]["name"])}, "arguments": {c["function"]["arguments"]}}}'
                 f"{END_TAG}" for c in message["tool_calls"]]
        out["content"] = "\n".join(([message["content"]] if message["content"] else []) + lines)
    elif message["role"] == "tool":
        attrs = "".join(f' {key}={json.dumps(message[field])}' for key, field in (("name", "name"),
                                                                                 ("id", "tool_call_id"))
                        if message.get(field))
        out["content"] = f"<tool_response{attrs}>\n{message['content']}\n</tool_response>"
    elif message.get("name"):
        out["name"] = message["name"]
    return out
