"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): its body -> the internal
chat request, the chat-shaped result -> a `message` object or that API's stream events (doors.py),
and its error object.

Read: `system` (a string or text blocks), `messages` with string or block content (`text`, `tool_use`,
`tool_result` with string or text-block content and `is_error`; `thinking` blocks are skipped), `system`
(and `developer`) messages inside `messages` (Anthropic's mid-conversation system messages: rendered where
they stand, so the prefix before them stays cached; their `tool_addition` / `tool_removal` blocks and any
other non-text block of a system prompt are passed over), `tools` (`input_schema`; `defer_loading` and
`cache_control` ignored; server tools such as web search are left out), `tool_choice` (`auto` / `any` / `tool` / `none`, `disable_parallel_tool_use`),
`stop_sequences`, `max_tokens` (required, as the API has it), `stream`, and the sampling fields
`temperature` (default 1.0, the API's), `top_p`, `top_k` -- the current `anthropic` SDK has no keywords
for our extensions (`min_p`, `seed`, `gamma`, ...): send them in the body (`extra_body`). Ignored:
`metadata`, `thinking`, `service_tier`, `cache_control` marks, `container`, `mcp_servers`,
`context_management`, `output_config`. Refused (400): images and documents.
"""

from __future__ import annotations

import json
import uuid

from ..generation import GenerationResult
from .api_error import ApiError
from .doors import Call, Output, chat_output, event, string_field

ENDPOINT, COUNT = "/v1/messages", "/v1/messages/count_tokens"
EXTENSIONS = ("min_p", "seed", "gamma", "lenience", "verification", "logit_bias", "presence_penalty",
              "frequency_penalty", "repetition_penalty")
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """The Messages API's error object."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def to_chat(body: dict, counting: bool = False) -> dict:
    """A Messages body -> the chat completion request's body (`counting`: count_tokens', no max_tokens)."""
    chat = {key: body[key] for key in ("model", "temperature", "top_p", "top_k", "stream", *EXTENSIONS) if key in body}
    if not counting:
        if "max_tokens" not in body:
            raise ApiError(400, "max_tokens: Field required", "max_tokens")
        chat["max_tokens"] = body["max_tokens"]
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    system = body.get("system")
    messages = [{"role": "system", "content": _blocks_text(system, "system", lenient=True)}] if system else []
    chat["messages"] = messages + chat_messages(body.get("messages"))
    last = chat["messages"][-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and last["content"] and len(chat["messages"]) > 1:
        chat["continue_final_message"] = True  # a prefill: the answer continues it, as the API has it
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"], parallel = chat_tool_choice(body["tool_choice"])
        if not parallel:
            chat["parallel_tool_calls"] = False
    return chat


def chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list of messages is required", "messages")
    out: list[dict] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system", "developer"):
            raise ApiError(400, f"{where}.role: must be user, assistant or system, got {role!r}", f"{where}.role")
        content = message.get("content")
        if role in ("system", "developer"):  # a mid-conversation system message: rendered where it stands
            out.append({"role": "system", "content": _blocks_text(content, f"{where}.content", lenient=True)})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content: must be a string or a list of content blocks", f"{where}.content")
        text, calls = [], []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(string_field(block, "text", at))
            elif kind == "tool_use" and role == "assistant":
                call_id, name = string_field(block, "id", at), string_field(block, "name", at)
                if not isinstance(block.get("input"), dict):
                    raise ApiError(400, f"{at}.input: must be an object", f"{at}.input")
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(block["input"], ensure_ascii=False,
                                                                            separators=(",", ":"))}})
            elif kind == "tool_result" and role == "user":
                call_id = string_field(block, "tool_use_id", at)
                result = _blocks_text(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": call_id, "content": result})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ApiError(400, f"{at}.type: {kind!r} blocks are not supported in a {role} message (this server "
                                    "reads text, tool_use and tool_result blocks)", f"{at}.type")
        if text or calls or not any(b.get("type") == "tool_result" for b in content if isinstance(b, dict)):
            entry = {"role": role, "content": "".join(text)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    if all(m["role"] == "system" for m in out):
        raise ApiError(400, "messages: at least one user or assistant message is required", "messages")
    return out


def _blocks_text(content, where: str, lenient: bool = False) -> str:
    """Text blocks joined. `lenient` (a system message's): blocks of other types (`tool_addition`,
    `tool_removal`, ...) carry no text for the model and are passed over; elsewhere they are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: must be a string or a list of text blocks", where)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            if lenient and isinstance(block, dict):
                continue
            raise ApiError(400, f"{where}.{j}.type: {kind!r} blocks are not supported: this server reads text only",
                           f"{where}.{j}.type")
        parts.append(string_field(block, "text", f"{where}.{j}"))
    return "".join(parts)



def chat_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise ApiError(400, "tools: must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"tools.{i}: must be an object", f"tools.{i}")
        if tool.get("type", "custom") != "custom":  # a server tool (web search, code execution, ...): not run here
            continue
        if "input_schema" not in tool:
            raise ApiError(400, f"tools.{i}: a custom tool needs an input_schema", f"tools.{i}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice) -> tuple[str | dict, bool]:
    """`tool_choice` -> (the chat tool_choice, whether parallel calls are allowed)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise ApiError(400, f"tool_choice.type: must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


class MessagesDoor:
    """The Messages API's shapes for one request (doors.Door). `stop_sequence(result)`: the stop string
    that ended a result, if one did."""

    def __init__(self, model: str, stop_sequence) -> None:
        self.model, self.stop_sequence = model, stop_sequence
        self.id = f"msg_{uuid.uuid4().hex}"
        self.output = Output()
        self.blocks = 0  # content blocks started
        self.open = False

    def message(self, output: Output, chat_usage: dict, result: GenerationResult, speculative: dict | None) -> dict:
        reason, stop = self._stop(output, result)
        content = [{"type": "text", "text": p} if isinstance(p, str) else
                   {"type": "tool_use", "id": p.id, "name": p.name, "input": _input(p.arguments)} for p in output.parts]
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
               "stop_reason": reason, "stop_sequence": stop, "usage": self._usage(chat_usage)}
        if speculative is not None:
            out["speculative"] = speculative
        return out

    def _stop(self, output: Output, result: GenerationResult) -> tuple[str, str | None]:
        stop = self.stop_sequence(result)
        if stop is not None:
            return "stop_sequence", stop
        return STOP_REASONS.get(output.finish_reason, "end_turn"), None

    @staticmethod
    def _usage(chat_usage: dict) -> dict:
        cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    # --- doors.Door ------------------------------------------------------------------------------
    def whole(self, chat: dict, results: list[GenerationResult]) -> dict:
        return self.message(chat_output(chat), chat["usage"], results[0], chat.get("speculative"))

    def opening(self, prompt_tokens: int) -> list[str]:
        start = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        return [event("message_start", {"type": "message_start", "message": start})]

    def keepalive(self) -> list[str]:
        return [event("ping", {"type": "ping"})]

    def chunk(self, chunk: dict) -> list[str]:
        events: list[str] = []

        def on_text(text: str) -> None:
            if len(self.output.parts) > self.blocks:  # a new text part: a new block
                events.extend(self._start({"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": text}))

        def on_call(call: Call) -> None:
            events.extend(self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}))

        def on_arguments(call: Call, fragment: str) -> None:
            events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))

        self.output.read(chunk, on_text, on_call, on_arguments)
        return events

    def closing(self, usage: dict, results: list[GenerationResult]) -> list[str]:
        reason, stop = self._stop(self.output, results[0])
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                 "usage": self._usage(usage["usage"])}
        if "speculative" in usage:
            delta["speculative"] = usage["speculative"]
        return self._stop_block() + [event("message_delta", delta), event("message_stop", {"type": "message_stop"})]

    def failure(self, error: ApiError) -> list[str]:
        return [event("error", error_body(error.status, error.message))]

    # --- the stream's blocks -----------------------------------------------------------------------
    def _start(self, block: dict) -> list[str]:
        events = self._stop_block()
        self.blocks += 1
        self.open = True
        return events + [event("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                                       "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def _stop_block(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]


def _input(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
