"""OpenAI's Responses API (`POST /v1/responses`): its body -> the internal chat request, the chat-shaped
result -> a `response` object or its typed stream events (doors.py), and the store behind
`previous_response_id`.

Read: `input` (a string, or items: messages with text parts, `function_call` and `custom_tool_call`
(with their `namespace`), `function_call_output`, `custom_tool_call_output`; `reasoning` items are
skipped), `instructions`, `tools` (function, namespace and custom tools: responses_tools.py; hosted tools
are left out of the prompt and logged once), `tool_choice`, `text.format` (text / json_object /
json_schema), `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls`, `stream`, `store`,
`previous_response_id`, and our extensions (`top_k`, `min_p`, `seed`, `gamma`, ...). Ignored: `metadata`
(echoed), `user`, `include`, `reasoning`, `truncation`, `service_tier`, `prompt_cache_key`,
`client_metadata`. Refused (400, naming the field): non-text content, `item_reference` items.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict

from ..generation import GenerationResult
from .api_error import ApiError
from .doors import Call, Output, chat_output, event, string_field
from .responses_tools import CUSTOM_INPUT, Tools, custom_input, flat_name, read_tools

ENDPOINT = "/v1/responses"
STORE_ENTRIES = 1024  # responses kept for previous_response_id (least recently used dropped first) ...
STORE_MB = 256.0  # ... in at most this many MiB (serve --responses-store-mb)
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # the API's limits on `metadata`
IGNORED = ("metadata", "user", "include", "reasoning", "truncation", "service_tier", "prompt_cache_key",
           "background", "safety_identifier", "max_tool_calls", "top_logprobs", "stream_options", "conversation")
EXTENSIONS = ("top_k", "min_p", "seed", "gamma", "lenience", "verification", "logit_bias", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "stop")


class ResponseStore:
    """Stored responses by id: the whole conversation each ended (instructions apart, which the API does
    not carry over) and the response object, at most `entries` of them in at most `budget_mb` MiB (their
    JSON's size; least recently used dropped first; one larger than the budget is not kept). The server
    reads and writes it off the event loop (app.Routes: the preparing thread)."""

    def __init__(self, entries: int = STORE_ENTRIES, budget_mb: float = STORE_MB) -> None:
        self.entries, self.budget, self.used = entries, int(budget_mb * 2**20), 0
        self._items, self._lock = OrderedDict(), threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        """Kept as JSON text (its size is its cost; each `get` reads a copy of its own)."""
        kept = (json.dumps(response), json.dumps(messages))
        size = len(kept[0]) + len(kept[1])
        if size > self.budget:
            return
        kept = (*kept, size)
        with self._lock:
            if (old := self._items.pop(response["id"], None)) is not None:
                self.used -= old[2]
            self._items[response["id"]] = kept
            self.used += size
            while len(self._items) > self.entries or self.used > self.budget:
                self.used -= self._items.popitem(last=False)[1][2]

    def delete(self, response_id: str) -> None:
        with self._lock:
            if (old := self._items.pop(response_id, None)) is None:
                raise ApiError(404, f"no stored response with id {response_id!r}", "response_id", "not_found")
            self.used -= old[2]

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        with self._lock:
            if response_id not in self._items:
                raise ApiError(404, f"no stored response with id {response_id!r} (responses are kept in memory, "
                                    f"the last {self.entries}, and only with store: true)",
                               "previous_response_id", "previous_response_not_found")
            self._items.move_to_end(response_id)
            response, messages, _ = self._items[response_id]
        return json.loads(response), json.loads(messages)


def to_chat(body: dict, store: ResponseStore) -> tuple[dict, list[dict], Tools]:
    """A Responses body -> (the chat completion request's body, the conversation without instructions,
    its tools as function tools and what their calls' names stand for)."""
    if not isinstance(body.get("store", True), bool):
        raise ApiError(400, "store must be true or false", "store")
    check_metadata(body.get("metadata"))
    previous = body.get("previous_response_id")
    history = []
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError(400, "previous_response_id must be a string", "previous_response_id")
        history = store.get(previous)[1]  # a copy of its own
    conversation = history + input_messages(body.get("input"))
    chat = {key: body[key] for key in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", *EXTENSIONS)
            if key in body}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if not chat["messages"]:
        raise ApiError(400, "input is empty: give a string or at least one item", "input")
    tools = read_tools(body["tools"]) if body.get("tools") else Tools()
    if tools.chat:
        chat["tools"] = tools.chat
    if "tool_choice" in body and (tools.chat or not body.get("tools")):
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if (text := body.get("text")) is not None:
        if not isinstance(text, dict):
            raise ApiError(400, "text must be an object {\"format\": {...}}", "text")
        if (fmt := response_format(text.get("format"))) is not None:
            chat["response_format"] = fmt
    return chat, conversation, tools


def check_metadata(metadata) -> None:
    """The API's limits on `metadata` (it is echoed and stored): at most 16 string pairs, keys of at most
    64 characters, values of at most 512."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > METADATA_KEYS:
        raise ApiError(400, f"metadata must be an object of at most {METADATA_KEYS} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
            raise ApiError(400, f"metadata: keys are strings of at most {METADATA_KEY_CHARS} characters, values "
                                f"strings of at most {METADATA_VALUE_CHARS}", f"metadata.{key[:64]}")


def input_messages(items) -> list[dict]:
    """`input` -> chat messages: a string is one user message; consecutive `function_call` items are one
    assistant message's tool calls, each `function_call_output` a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(400, "input must be a string or a list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = string_field(item, "call_id", where), string_field(item, "name", where)
            if kind == "custom_tool_call":
                arguments = json.dumps({CUSTOM_INPUT: string_field(item, "input", where)}, ensure_ascii=False)
            else:
                arguments = string_field(item, "arguments", where)
            namespace = item.get("namespace")
            name = flat_name(namespace if isinstance(namespace, str) else None, name)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = string_field(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing this server's models read
        else:
            raise ApiError(400, f"{where}.type {kind!r} is not supported (this server reads message, function_call, "
                                "function_call_output and reasoning items)", f"{where}.type")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}", f"{where}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{where}.content")
    return {"role": role, "content": text}


def _text(parts, where: str) -> str:
    """Text parts (`input_text`, `output_text`, `text`, `refusal`) joined; anything else refused."""
    if not isinstance(parts, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise ApiError(400, f"{where}[{j}]: content parts of type {kind!r} are not supported: this server "
                                "reads text only", f"{where}[{j}].type")
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise ApiError(400, f"{where}[{j}].text must be a string", f"{where}[{j}].text")
        out.append(value)
    return "".join(out)



def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):  # a custom tool's name is its function's
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function" | "custom", "name": ...}',
                   "tool_choice")


def response_format(fmt) -> dict | None:
    """`text.format` -> the chat request's response_format (None: plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be a JSON schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"]}}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format.type")


class ResponsesDoor:
    """The Responses API's shapes for one request (doors.Door); a completed response is stored for
    `previous_response_id` when the request's `store` is not false."""

    def __init__(self, body: dict, conversation: list[dict], store: ResponseStore, model: str,
                 tools: Tools | None = None) -> None:
        self.body, self.conversation, self.store, self.model = body, conversation, store, model
        self.tools = tools or Tools()
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.output = Output()
        self.items: list[dict] = []  # the stream's output items, as added
        self.sequence = 0

    def skeleton(self, status: str) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": None, "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"), "model": self.model, "output": [],
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
                "store": body.get("store", True) is not False, "temperature": body.get("temperature", 1.0),
                "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0), "truncation": "disabled",
                "usage": None, "metadata": body.get("metadata") or {}}

    def response(self, output: Output, items: list[dict], chat_usage: dict, speculative: dict | None) -> dict:
        """The finished response object (`items`: `output`'s parts as output items); stored when asked."""
        out = self.skeleton("incomplete" if output.finish_reason == "length" else "completed")
        if output.finish_reason == "length":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["output"] = items
        cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        written = chat_usage["prompt_tokens"] - cached  # the prefix cache keeps what was not read from it
        out["usage"] = {"input_tokens": chat_usage["prompt_tokens"],
                        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
                        "output_tokens": chat_usage["completion_tokens"],
                        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": chat_usage["total_tokens"]}
        if speculative is not None:
            out["speculative"] = speculative
        if out["store"]:
            self.store.put(out, self.conversation + [_assistant(output)])
        return out

    # --- doors.Door ------------------------------------------------------------------------------
    def whole(self, chat: dict, results: list[GenerationResult]) -> dict:
        output = chat_output(chat)
        return self.response(output, [self._item(part) for part in output.parts], chat["usage"],
                             chat.get("speculative"))

    def opening(self, prompt_tokens: int) -> list[str]:
        start = self.skeleton("in_progress")
        return [self._event("response.created", response=start), self._event("response.in_progress", response=start)]

    def keepalive(self) -> list[str]:
        return [self._event("response.in_progress", response=self.skeleton("in_progress"))]

    def chunk(self, chunk: dict) -> list[str]:
        events: list[str] = []

        def on_text(text: str) -> None:
            if not self.items or self.items[-1]["type"] != "message":
                events.extend(self._close())
                self.items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                   "role": "assistant", "content": []})
                events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                          item=self.items[-1]))
                events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []}))
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                      logprobs=[]))

        def on_call(call: Call) -> None:
            events.extend(self._close())
            self.items.append(self.tools.output_item(call.id, call.name, "", f"fc_{uuid.uuid4().hex}", "in_progress"))
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=self.items[-1]))

        def on_arguments(call: Call, fragment: str) -> None:
            if self.items[-1]["type"] == "function_call":  # a custom tool's raw input is sent whole at its end
                events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=fragment))

        self.output.read(chunk, on_text, on_call, on_arguments)
        return events

    def closing(self, usage: dict, results: list[GenerationResult]) -> list[str]:
        events = self._close()
        final = self.response(self.output, self.items, usage["usage"], usage.get("speculative"))
        name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [self._event(name, response=final)]

    def failure(self, error: ApiError) -> list[str]:
        failed = self.skeleton("failed")
        failed["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]

    # --- the stream's items ------------------------------------------------------------------------
    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _close(self) -> list[str]:
        """The events that finish the open output item (none when none is open)."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item, part = self.items[-1], self.output.parts[len(self.items) - 1]
        item["status"] = "completed"
        if item["type"] == "message":
            text = {"type": "output_text", "text": part, "annotations": []}
            item["content"] = [text]
            events = [self._event("response.output_text.done", **self._where(), content_index=0, text=part, logprobs=[]),
                      self._event("response.content_part.done", **self._where(), content_index=0, part=text)]
        elif item["type"] == "custom_tool_call":
            item["input"] = custom_input(part.arguments)
            events = [self._event("response.custom_tool_call_input.delta", **self._where(), delta=item["input"]),
                      self._event("response.custom_tool_call_input.done", **self._where(), input=item["input"])]
        else:
            item["arguments"] = part.arguments
            events = [self._event("response.function_call_arguments.done", **self._where(), name=item["name"],
                                  arguments=part.arguments)]
        return events + [self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def _item(self, part: str | Call) -> dict:
        if isinstance(part, str):
            return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": part, "annotations": []}]}
        return self.tools.output_item(part.id, part.name, part.arguments, f"fc_{uuid.uuid4().hex}", "completed")

    def _event(self, kind: str, **data) -> str:
        self.sequence += 1
        return event(kind, {"type": kind, "sequence_number": self.sequence - 1, **data})


def _assistant(output: Output) -> dict:
    """The answer as the chat message a later turn's history holds."""
    text = "".join(p for p in output.parts if isinstance(p, str))
    message = {"role": "assistant", "content": text}
    if calls := output.calls():
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message
