"""Request bodies of the OpenAI-compatible endpoints.

Types are strict (a string where a number belongs is an error, not coerced) and every number is
finite. Fields we cannot honour are refused (400), not ignored: `top_logprobs` without `logprobs`,
completions' `echo` / `suffix` / a `best_of` other than n, non-text content parts. Unknown fields
(`user`, `store`, ...) are accepted and ignored, as OpenAI clients send them (docs/server.md lists them;
`parallel_tool_calls` is read by translate.py for a tool family's template). Limits that depend on the loaded model (the context size) or bound a request's cost are
checked by the app (limits.py), not here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..speculative.params import VERIFICATIONS
from .limits import MAX_MESSAGES

MAX_N = 8  # samples per request; they decode as rows of the running batch


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"] = "text"  # image_url, input_audio, ...: this server reads text only
    text: str


ROLES = Literal["system", "developer", "user", "assistant", "tool", "function"]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: ROLES
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        for part in content if isinstance(content, list) else []:
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this server reads text only")
        return content

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message carries tool_calls, not a {self.role} message")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (only an assistant message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class GenerationRequest(_Strict):
    """Fields shared by chat and text completions: OpenAI's, plus `top_k`, `min_p`, `gamma` (draft
    tokens per target call, or "auto"; None: the engine's), `lenience` and `verification`."""

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63 - MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    gamma: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    lenience: float = Field(1.0, gt=0, le=1)  # 1 = exact; < 1 accepts more drafts and is LOSSY
    verification: Literal[VERIFICATIONS] = "token"  # "block": drafts with a real law verified jointly (exact)
    # the law (speculative/law.py): grammar, bias and penalties, applied to target and drafts alike
    response_format: dict | None = None  # OpenAI's, plus {"type": "regex", "regex"} / {"type": "grammar", "grammar"}
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)

    def stop_list(self) -> list[str]:
        """`stop` as a list (OpenAI accepts one string or several)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    continue_final_message: bool = False  # the last (assistant) message is a prefill the answer continues

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _continued_message_is_an_answer(self) -> "ChatCompletionRequest":
        last = self.messages[-1]
        if self.continue_final_message and (last.role != "assistant" or last.tool_calls or len(self.messages) < 2):
            raise ValueError("continue_final_message needs a last assistant message without tool calls, after "
                             "another message")
        return self

    def logprobs_k(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self) -> int | None:
        """`max_completion_tokens` (OpenAI's newer name) or `max_tokens`; None means the rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict]:
        """The messages as dicts (tool calls, tool_call_id and name kept; see history.py)."""
        return [m.model_dump(exclude_none=True, include={"role", "name", "tool_calls", "tool_call_id"})
                | {"content": m.text()} for m in self.messages]


class CompletionRequest(GenerationRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] = False  # echoing the prompt back is not supported
    suffix: Literal[""] | None = None  # insertion (text after the completion) is not supported
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _best_of_is_n(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}): ranking extra samples is not supported")
        return self

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def token_budget(self) -> int:
        """`max_tokens`, with OpenAI's default of 16 for text completions."""
        return self.max_tokens if self.max_tokens is not None else 16

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
