"""Front doors: the wire shapes of one API over the one internal request and its chat-shaped output.

Every API the server speaks (OpenAI chat completions, OpenAI Responses, Anthropic Messages) is
translated into a `ChatCompletionRequest` -- messages, tools and tool history, sampling, limits, a
response format -- and planned by `translate.plan_chat` through the model's own template, the tool
families and `generation.law_spec`: the same conversation through any door is the same prompt and,
greedy, the same text. What differs is the wire: a door turns the chat-shaped result (the
non-streamed body `responses.Shapes` builds, or the chunks `streaming.StreamedChoice` yields) into
its own API's body, server-sent events and error object.

    whole(chat, results)   -> the non-streamed body
    opening(prompt_tokens) -> events before the first chunk (the prompt's token count: Messages reports it)
    keepalive()            -> a sign of life while nothing else comes (a long prefill)
    chunk(chunk)           -> the events of one chat chunk
    closing(usage, results)-> the events after the last chunk (usage: the chat usage chunk's object)
    failure(error)         -> the events of an error once the stream has begun
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..generation import GenerationResult
from .api_error import ApiError
from .shapes import error_body, sse


class Door(Protocol):
    """One API's wire shapes (see the module docstring)."""

    def whole(self, chat: dict, results: list[GenerationResult]) -> dict: ...

    def opening(self, prompt_tokens: int) -> list[str]: ...

    def keepalive(self) -> list[str]: ...

    def chunk(self, chunk: dict) -> list[str]: ...

    def closing(self, usage: dict, results: list[GenerationResult]) -> list[str]: ...

    def failure(self, error: ApiError) -> list[str]: ...


class ChatDoor:
    """OpenAI chat and text completions: the chat shapes as they are, `data: [DONE]` last."""

    def __init__(self, include_usage: bool = False) -> None:
        self.include_usage = include_usage

    def whole(self, chat: dict, results: list[GenerationResult]) -> dict:
        return chat

    def opening(self, prompt_tokens: int) -> list[str]:
        return []

    def keepalive(self) -> list[str]:
        return [KEEPALIVE_COMMENT]

    def chunk(self, chunk: dict) -> list[str]:
        return [sse(chunk)]

    def closing(self, usage: dict, results: list[GenerationResult]) -> list[str]:
        return ([sse(usage)] if self.include_usage else []) + [sse("[DONE]")]

    def failure(self, error: ApiError) -> list[str]:
        return [sse(error_body(error.message, error.param, error.code, error.type)), sse("[DONE]")]


SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value, where: str = "body") -> None:
    """Refuse (400, naming the field) a string holding a lone surrogate anywhere in a JSON body: no text
    encodes it, so a response echoing the field could not be written (found before any work is done)."""
    if isinstance(value, str):
        if SURROGATE.search(value):
            raise ApiError(400, f"{where}: a string holds a lone surrogate (not valid Unicode text)", where)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, where)
            check_text(item, f"{where}.{key}" if where != "body" else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{where}[{i}]")


KEEPALIVE_COMMENT = ": keep-alive\n\n"  # an SSE comment: every client skips it


def event(name: str, data: dict) -> str:
    """One named server-sent event (the Responses and Messages APIs name each event)."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


@dataclass
class Call:
    """A tool call read from the chat stream: its id, name and argument text so far."""

    id: str
    name: str
    arguments: str = ""


@dataclass
class Output:
    """What one answer said, in order: text and calls, as the chat stream's deltas give them."""

    parts: list[str | Call] = field(default_factory=list)
    finish_reason: str | None = None

    def read(self, chunk: dict, on_text: Callable[[str], None], on_call: Callable[[Call], None],
             on_arguments: Callable[[Call, str], None]) -> None:
        """Fold one chat chunk (choice 0) in, calling back for each new text piece, call and argument
        fragment."""
        choice = chunk["choices"][0]
        delta = choice.get("delta", {})
        for item in delta.get("tool_calls") or []:
            function = item.get("function", {})
            if "id" in item:
                call = Call(item["id"], function["name"])
                self.parts.append(call)
                on_call(call)
            elif function.get("arguments"):
                call = self.calls()[-1]
                call.arguments += function["arguments"]
                on_arguments(call, function["arguments"])
        if delta.get("content"):
            if not self.parts or not isinstance(self.parts[-1], str):
                self.parts.append("")
            self.parts[-1] += delta["content"]
            on_text(delta["content"])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def calls(self) -> list[Call]:
        return [p for p in self.parts if isinstance(p, Call)]


def chat_output(chat: dict) -> Output:
    """The non-streamed chat body's choice 0 as an `Output`: its content, then its calls."""
    choice = chat["choices"][0]
    message = choice["message"]
    parts: list[str | Call] = [message["content"]] if message.get("content") else []
    parts += [Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return Output(parts, choice["finish_reason"])


def stop_sequence(result: GenerationResult, stops: list[str], eos: set[int], decode: Callable[[list[int]], str]) -> str | None:
    """The stop string that ended `result`, if one did (not EOS, not the budget)."""
    if result.finish_reason != "stop" or not stops or (result.token_ids and result.token_ids[-1] in eos):
        return None
    rest = decode(result.token_ids)[len(result.text):]
    found = [(rest.find(s), s) for s in stops if s in rest]
    return min(found)[1] if found else None



def string_field(item: dict, key: str, where: str) -> str:
    """`item[key]`, which must be a string: else a 400 naming `where.key` (both doors' bodies)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", f"{where}.{key}")
    return value
