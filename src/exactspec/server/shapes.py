"""OpenAI response and stream-chunk shapes for chat and text completions, plus the error object."""

from __future__ import annotations

import json
import time
import uuid

from ..engine import GenerationResult
from ..stats import Stats


def error_body(message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def speculative(stats: Stats, reproducible: bool = True, identity: dict | None = None) -> dict:
    """The `speculative` extension: how much drafting saved, whether a seed reproduces the text, and
    (`identity`, the engine's: loading.identity, as `/v1/models` reports it) what those rest on:
    `greedy` (speculative == plain) and `reproducible` (alone == batched == after a prefix-cache hit),
    each "bit-exact (self-tested)", "by tolerance", "untested device (CUDA)" or "not self-tested"."""
    out = {
        "proposed": stats.proposed,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "target_calls": stats.target_calls,
        "tokens_per_target_call": stats.tokens_per_target_call,
        "drafts_by": stats.drafts_by,  # target calls with drafts per drafter (--draft auto's choices)
        "lenience": stats.lenience,  # 1 = exact; < 1 = lossy (the output law is not the target's)
        # the rule that verified the drafts: "block" when any target call verified them jointly; a request
        # asking for block with point-mass drafts (prompt lookup, suffix) or at T = 0 got the token rule
        "verification": "block" if stats.block_verified else "token",
        "block_verified": stats.block_verified,  # target calls whose drafts were verified as a block
        "exact": stats.exact,
        "forced": stats.forced,
        "reproducible": reproducible,  # the same request with the same seed gives the same text
    }
    if identity is not None:
        out["identity"] = dict(identity)
    return out


def usage(prompt_tokens: int, results: list[GenerationResult]) -> dict:
    completion = sum(len(r.token_ids) for r in results)
    cached = results[0].stats.cached_tokens if results else 0  # a request's samples share one prefill
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def merged_stats(results: list[GenerationResult]) -> Stats:
    total = Stats()
    for r in results:
        total = total.merge(r.stats)
    return total


class Shapes:
    """Builds the bodies of one response (one id and timestamp), chat or text flavoured."""

    def __init__(self, chat: bool, model: str, token_text=None, tools=None, token_bytes=None,
                 reproducible: bool = True, identity: dict | None = None) -> None:
        self.chat, self.model, self.reproducible = chat, model, reproducible
        self.identity = identity  # what greedy identity and reproducibility rest on (`speculative`)
        self.token_text, self.token_bytes = token_text, token_bytes  # token id -> its text, its bytes (logprobs)
        self.tools = tools  # server.tools.ToolPlan: the output is read as tool calls
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, prompt_tokens: int, results: list[GenerationResult]) -> dict:
        """The whole (non-streaming) response."""
        choices = []
        for index, r in enumerate(results):
            choice = {"index": index, "logprobs": self.logprobs(r), "finish_reason": self.finish_reason(r)}
            if self.chat:
                content, calls = self.read(r)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
            else:
                choice["text"] = r.text
            choices.append(choice)
        return self._envelope("chat.completion" if self.chat else "text_completion", choices,
                              usage=usage(prompt_tokens, results),
                              speculative=speculative(merged_stats(results), self.reproducible, self.identity))

    def read(self, r: GenerationResult) -> tuple[str | None, list[dict] | None]:
        """(content, tool_calls) of a chat result."""
        if self.tools is None:
            return r.text, None
        return self.tools.read(r.text, r.finish_reason == "stop")

    def finish_reason(self, r: GenerationResult) -> str:
        return "tool_calls" if self.tools is not None and self.read(r)[1] else r.finish_reason

    def logprobs(self, r: GenerationResult) -> dict | None:
        """OpenAI's logprobs object of a whole result, or None (no logprobs asked for).
        Log-probabilities are the target's raw law (log-softmax of its logits, before any warp or mask)."""
        if r.logprobs is None or self.token_text is None:
            return None
        return self.logprob_object(r.logprobs[: len(r.token_ids)])

    def logprob_object(self, entries: list[dict], offset: int = 0) -> dict:
        """OpenAI's logprobs object for `entries` (`GenerationResult.logprobs` items): chat, `content`
        entries; completions, parallel lists whose `text_offset` starts at `offset` (a stream's chunks
        continue where the previous one ended)."""
        text = self.token_text
        if self.chat:
            def item(token, lp):
                return {"token": text(token), "logprob": lp, "bytes": list(self.token_bytes(token))}
            return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                                for e in entries], "refusal": None}
        tokens = [text(e["token"]) for e in entries]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{text(t): lp for t, lp in e["top"]} for e in entries], "text_offset": offsets}

    def chunk(self, index: int, text: str = "", finish_reason: str | None = None, first: bool = False,
              logprobs: dict | None = None, tool_call: dict | None = None) -> dict:
        """A stream chunk for choice `index`: the first one of a chat choice also carries the role;
        `tool_call`: a chat delta's `tool_calls` item instead of content."""
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice["delta"] = {"tool_calls": [tool_call]} if tool_call is not None else delta
            return self._envelope("chat.completion.chunk", [choice])
        choice["text"] = text
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, results: list[GenerationResult]) -> dict:
        """The last chunk when `stream_options.include_usage` is set: no choices, usage and stats."""
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(object_, [], usage=usage(prompt_tokens, results),
                              speculative=speculative(merged_stats(results), self.reproducible, self.identity))
